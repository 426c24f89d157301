"""Multi-GPU bursts: tensor-parallel and pipeline-parallel targets (docs/parallel.md).

* :mod:`.dist`: process-group setup and teardown with timeouts, layout validation
  before any collective, the config-hash agreement, the collectives' helpers.
* :mod:`.tp`: a Llama sharded over the ranks of a tensor-parallel group.
* :mod:`.pp`: a Llama split into pipeline stages, and the stage-local rollback table.
* :mod:`.check`: the in-graph rank-agreement checksum, compared at drain.
* :mod:`.runner`: the parallel decoder and burst (one replay per burst per GPU).
* :mod:`.launch`: ``torchrun ... -m graphburst demo --tp/--pp``.
* :mod:`.lockstep`: ``torchrun ... -m graphburst serve --tp N``: rank 0 serves, the ranks step in lockstep.
"""
