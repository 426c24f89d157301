"""Named sentinels and limits shared by the kernels, the reference and the host code.

The CUDA source defines the same values as ``GB_*`` macros; ``tests/kernels/test_reference.py``
checks that the two stay in step.
"""

PLACEHOLDER_TOKEN = -1  # verify positions past the p-min break; poison in tests
NO_EOS = -1  # eos[b] for a sequence that never stops on a token
UNBOUNDED_BUDGET = 2**31 - 1  # budget[b] for a sequence with no token limit
NO_PREFILL = -1  # prompt_len[b] for a slot a prefill call leaves untouched
ABSENT_LAYER = 0  # pointer-table entry of a layer without KV (linear attention, KV-shared)
RING_COUNT_COLUMN = 0  # ring[b, 0] holds the number of tokens committed this burst

MAX_K = 64  # drafts per round; bounds the verify kernel's shared memory
DEFAULT_K = 4  # drafts per round of a command given a draft and no -k (with no draft: 0, plain decoding)
MAX_TABLE_ENTRIES = 65535  # rollback walks the table on gridDim.y
THREADS_PER_BLOCK = 128  # one-thread-per-sequence kernels
MAX_LAYER_THREADS = 256  # stub models: threads per block striding over layers
NO_BATCH_LIMIT = 2**31 - 1  # spec_max_batch of a decoder that never switches speculation off
CAP_THREADS = 256  # threads of the draft cap kernel's one block (GB_CAP_THREADS)
MAX_DEPTH = 8  # bursts a gapless BurstGraph keeps in flight: each holds a pinned output block and a graph
TP_MAX_DEPTH = 2  # the same for a tensor-parallel graph (parallel/check.py: one pinned rank-check vector each)

# Sampling (kernels.cu "Sampling" section; sampling_ref.py is its numpy twin)
SAMPLE_THREADS = 256  # threads per sampling block; with SAMPLE_TILE it fixes the summation order the twins mirror
SAMPLE_TILE = 2048  # vocabulary elements per sampling block (several blocks per row)
SELECT_THREADS = 512  # threads per block of the top-k/top-p select (kernels.cu GB_SEL_THREADS)
SELECT_DIGIT = 11  # bits of the select's radix digit (GB_SEL_DIGIT)
SELECT_BINS = 1 << SELECT_DIGIT  # histogram bins per row (GB_SEL_BINS)
RACES_PER_ROW = 2  # race partials per scratch row: [0] draft / residual, [1] the bonus race over p (GB_RACES_PER_ROW)
SAMPLE_MAX_VOCAB = 1 << 20  # keeps a row's top-p mass (2**32 per token at most) exact in a double
DRAW_DRAFT = 0  # Philox counter word 1: the draft's proposal for a position
DRAW_ACCEPT = 1  # the uniform of the accept test for a position
DRAW_RESAMPLE = 2  # the replacement (after a rejection) or bonus token for a position
GREEDY_TEMPERATURE = 0.0  # temperature[b] that turns a row into a one-hot at its argmax
TOP_K_OFF = 0  # top_k[b] that keeps every token
TOP_P_OFF = 1.0  # top_p[b] that keeps every token
SEED_LIMIT = 2**64  # seeds are uint64: [0, SEED_LIMIT)

# Prompt-lookup drafting (kernels/ngram.cuh; ngram_ref.py is its numpy twin)
NGRAM_MAX = 16  # longest n-gram the search tries (GB_NGRAM_MAX)
NGRAM_THREADS = 512  # threads per sequence of the search (GB_NGRAM_THREADS)

# Logits processing fields (kernels/fields.cuh; fields_ref.py is its numpy twin)
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (the OpenAI API's limit); the device table's width
LOGIT_BIAS_LIMIT = 100.0  # |bias| <= this (the OpenAI API's range)
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty| <= this (the OpenAI API's range)
FIELDS_THREADS = 256  # threads per block of the fields kernel (GB_FIELDS_THREADS)
FIELDS_SPAN = 1024  # vocabulary elements per block of the fields kernel (GB_FIELDS_SPAN)

# Device-exit bursts (kernels/round_exit.cu, a module of its own; round_exit_ref.py is its numpy twin)
EXIT_WORDS = 4  # int32 words of a device-exit burst's loop state (GB_EXIT_WORDS)
EXIT_ROUNDS = 0  # state[EXIT_ROUNDS]: rounds the burst has run (GB_EXIT_ROUNDS)
EXIT_GO = 1  # state[EXIT_GO]: 1 while the loop runs another round (GB_EXIT_GO)
EXIT_ACK = 2  # state[EXIT_ACK]: the stop-request count the device has answered (GB_EXIT_ACK)
EXIT_REASON = 3  # state[EXIT_REASON]: why the loop ended, one of the EXIT_BY_* values (GB_EXIT_REASON)
EXIT_RUNNING = 0  # reason while the loop still runs (GB_EXIT_RUNNING)
EXIT_BY_ROUNDS = 1  # it ran M_max rounds (GB_EXIT_BY_ROUNDS)
EXIT_BY_IDLE = 2  # no slot has budget left (GB_EXIT_BY_IDLE)
EXIT_BY_FLAG = 3  # the host asked it to stop (GB_EXIT_BY_FLAG)
EXIT_THREADS = 256  # threads of the condition kernel's one block (GB_EXIT_THREADS)
STOP_COUNT_MASK = 0x7FFFFFFF  # the host's stop-request count wraps within int32 (compared for equality only)
#: ``Llama(decode_kernels=...)``: how decode and verify forwards run (``models/llama.py`` says what each is);
#: ``graphburst serve``, ``demo``, ``bench real`` and ``bench ngram`` take it as ``--decode-kernels``
DECODE_KERNELS = ("auto", "gemv", "pdl", "folded", "reference", "off")
#: the choices that run graphburst's Triton kernels (on CUDA, or on the CPU under TRITON_INTERPRET=1)
TRITON_DECODE_KERNELS = ("gemv", "pdl", "folded")
