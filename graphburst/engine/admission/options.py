"""Per-slot model options that are one int32 each: written by the decoder at admission.

A model declares them through the protocol hook ``option_columns`` (see
:mod:`graphburst.protocol`): fixed ``[B]`` int32 device arrays, one per value of the tuple
its ``slot_options`` returns. The decoder gathers both models' columns into one pointer
table, and admission carries each admitted slot's values as extra rows of its slot table,
so the one ``admit_slots`` launch writes them: no upload or launch per model at each
refill, which the GPU may be waiting on. Outside admission (``set_slot_options``) the
values are scattered column by column.
"""

from __future__ import annotations

import numpy as np

from ...buffers import PtrTable
from ...protocol import hook

#: who declares option columns: the two models, then the decoder's draft caps (``engine/draft_caps.py``)
ROLES = ("target", "draft", "speculation")
_INT32 = (-(2**31), 2**31 - 1)


def scatter_columns(backend, columns, settings: dict, defaults: tuple, stream) -> None:
    """Write ``settings`` (slot -> a tuple of one int32 value per column, None for ``defaults``)
    into ``columns`` ([B] int32 device arrays) at the named slots only: one stream-ordered scatter
    per column (temporaries from the pool, so never under capture). What a model's own
    ``set_slot_options`` does with its option columns outside admission."""
    slots = list(settings)
    if not slots:
        return
    values = [defaults if v is None else v for v in settings.values()]
    for column, column_values in zip(columns, zip(*values)):
        backend.scatter(column.view(np.int32), slots, list(column_values), stream)


def _column_values(role: str, model, values, n: int) -> tuple:
    """``values`` (what ``slot_options`` returned) checked as ``n`` ints in int32 range."""
    if not isinstance(values, tuple) or len(values) != n:
        raise TypeError(f"{role} {type(model).__name__}: slot_options must return a tuple of {n} ints, one per "
                        f"option column, got {values!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not _INT32[0] <= v <= _INT32[1]:
            raise TypeError(f"{role} {type(model).__name__}: option column values must be ints in int32 range "
                            f"(a uint32 as its int32 bit pattern), got {values!r}")
    return tuple(int(v) for v in values)


class OptionColumns:
    """Both models' option columns (only the models that declare any).

    The columns are read from the models again whenever a model reports a watched attribute
    rebound (an n-gram draft's ``n_min``, say) or the decoder refreshes its tables, so the
    pointer table always names the arrays the models' kernels read.

    Attributes
    ----------
    table : PtrTable
        The columns' addresses, target's first: what ``admit_slots`` writes through.
    columns : tuple of [B] arrays
        The columns themselves, in table order.
    roles : tuple of str
        The roles with columns, in table order.
    count : int
        Columns in all (C): the admission table's extra rows (fixed: the staging is sized by it).
    """

    def __init__(self, models: dict, batch: int, backend, stream):
        self._models = {role: models[role] for role in ROLES if models.get(role) is not None}
        # the decoder's stream: a rebuilt pointer table is copied in order with the launches that read it
        self._batch, self._backend, self._stream = batch, backend, stream
        self.roles = tuple(role for role in self._models if tuple(hook(self._models[role], "option_columns")()))
        self.count = None
        self._build()
        for role in self.roles:
            self._check_defaults(role)
            model = self._models[role]
            for holder in (model, *hook(model, "watched")()):
                if hasattr(holder, "watch"):
                    holder.watch(self)

    @classmethod
    def of(cls, models: dict, batch: int, backend, stream) -> OptionColumns | None:
        """The columns of ``models`` (role -> model, or the decoder's DraftCaps for
        ``"speculation"``; a role may be absent or None), their pointer table built on ``stream``;
        None when none declares any."""
        cols = cls(models, batch, backend, stream)
        return cols if cols.count else None

    def _build(self) -> None:
        columns = []
        for role in self.roles:
            model = self._models[role]
            for i, col in enumerate(tuple(hook(model, "option_columns")())):
                if tuple(col.shape) != (self._batch,) or np.dtype(col.dtype).itemsize != 4 or \
                        not col.flags.c_contiguous:
                    raise TypeError(f"{role} {type(model).__name__}: option column {i} must be a contiguous "
                                    f"[{self._batch}] array of 4-byte ints, got {col.dtype} {tuple(col.shape)}")
                columns.append(col)
        if self.count is not None and len(columns) != self.count:
            raise TypeError(f"the models now declare {len(columns)} option columns, not {self.count}: the decoder's "
                            "staging is sized for the columns it was built with")
        self.count = len(columns)
        self.columns = tuple(columns)
        self._table = PtrTable(columns, self._backend, stream=self._stream) if columns else None
        self._stale = False

    def _check_defaults(self, role: str) -> tuple:
        model = self._models[role]
        return _column_values(role, model, hook(model, "slot_options")({}), len(hook(model, "option_columns")()))

    def invalidate(self, what: str = "") -> None:
        """A model rebound a watched attribute (or the decoder refreshes its tables): read the
        columns again before the next write."""
        self._stale = True

    @property
    def table(self) -> PtrTable:
        return self._current()._table

    def _current(self) -> OptionColumns:
        """Self, with the columns read again from the models first if one rebound them."""
        if self._stale:
            self._build()
        return self

    def rows(self, settings: list) -> list:
        """The ``C`` table rows for one admission: ``settings`` holds one entry per admitted slot
        (a ``slot_options`` result of the decoder, ``{role: value}``, or None for the defaults,
        asked of the model now, as its own ``slot_options({})`` gives them).
        Returns C lists of one int per slot."""
        values, defaults = [], {}
        roles, models = self.roles, self._models
        for setting in settings:
            row = ()
            for role in roles:
                v = None if setting is None else setting[role]
                if v is None:
                    v = defaults.get(role)
                    if v is None:
                        v = defaults[role] = hook(models[role], "slot_options")({})
                row += v
            values.append(row)
        return [list(col) for col in zip(*values)]

    def scatter(self, backend, settings: dict, stream) -> None:
        """Write ``settings`` (slot -> ``slot_options`` result or None) outside admission: a
        stream-ordered scatter per column (allocates temporaries, so never under capture)."""
        if settings:
            rows = self.rows(list(settings.values()))  # both roles' columns, defaults filled in
            scatter_columns(backend, self._current().columns, dict(zip(settings, zip(*rows))), (), stream)

    def owns(self, role: str) -> bool:
        """Whether ``role``'s options are columns (the decoder writes them)."""
        return role in self.roles
