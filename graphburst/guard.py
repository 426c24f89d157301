"""Address guard: a captured graph must never replay over buffers that moved.

An object that holds baked buffers tells its guards when it rebinds one, so the
per-replay check is a single attribute test. It does so through a :class:`Watcher` it
owns: plain data holders (buffers, caches, pointer tables, models) derive from
:class:`Watched`, whose ``__setattr__`` tells it for the attributes they list in
``_watched``; a class with a hot path of its own (the decoder) owns one and tells it from
the setters of the few attributes it lets be rebound. :meth:`AddressGuard.verify` re-reads
every recorded address, for buffers held by objects that tell no guard (a caller's own
model) or changed in place.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable


class StaleGraphError(RuntimeError):
    """A buffer baked into a graph was reallocated, resized or released."""


class Watcher:
    """The guards (anything with ``invalidate(what)``) watching one holder's baked attributes.

    Held weakly: a guard lives as long as its graph or program, not as long as the holder.

    Parameters
    ----------
    owner : str
        The holder's name in a stale guard's message (``"SpecDecoder"``: ``"SpecDecoder.table"``).
    """

    __slots__ = ("owner", "_guards")

    def __init__(self, owner: str):
        self.owner = owner
        self._guards = weakref.WeakSet()

    def watch(self, guard) -> None:
        """Register ``guard`` to be told when a watched attribute is rebound (idempotent)."""
        self._guards.add(guard)

    def rebound(self, name: str) -> None:
        """The holder rebinds (or deletes) ``name``: every guard watching it goes stale."""
        for guard in list(self._guards):
            guard.invalidate(f"{self.owner}.{name}")


class Watched:
    """Mixin of plain data holders: rebinding or deleting an attribute named in ``_watched``
    tells the holder's :class:`Watcher` (made at the first :meth:`watch`)."""

    _watched: frozenset = frozenset()

    def __setattr__(self, name, value) -> None:
        if name in self._watched and name in self.__dict__:
            self._notify(name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name) -> None:
        if name in self._watched:
            self._notify(name)
        object.__delattr__(self, name)

    def watch(self, guard: AddressGuard) -> None:
        """Register ``guard`` to be told when a watched attribute changes."""
        watcher = self.__dict__.get("_watcher")
        if watcher is None:
            watcher = Watcher(type(self).__name__)
            object.__setattr__(self, "_watcher", watcher)
        watcher.watch(guard)

    def _notify(self, name: str) -> None:
        watcher = self.__dict__.get("_watcher")
        if watcher is not None:
            watcher.rebound(name)


class AddressGuard:
    """Addresses and sizes of every buffer a graph baked in, recorded at capture.

    Parameters
    ----------
    buffers : dict of name -> getter
        Each getter returns the buffer currently at that place.
    holders : iterable
        Objects (each with ``watch(guard)``) whose attribute rebinding invalidates the graph.
    address : callable
        Maps an array to its address.
    """

    def __init__(self, buffers: dict[str, Callable], holders, address: Callable):
        self._getters = dict(buffers)
        self._address = address
        self.records = {name: self._read(get) for name, get in self._getters.items()}
        self.stale: str | None = None
        for holder in holders:
            holder.watch(self)

    def _read(self, get):
        arr = get()
        return self._address(arr), int(arr.nbytes)

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct buffers recorded."""
        return sum({addr: n for addr, n in self.records.values()}.values())

    def invalidate(self, what: str) -> None:
        if self.stale is None:
            self.stale = what

    def check(self) -> None:
        """O(1) per-replay check: raise if a watched buffer was rebound since capture."""
        if self.stale is not None:
            raise StaleGraphError(
                f"{self.stale} was reallocated or released after capture; recapture() before replaying")

    def verify(self) -> None:
        """Full check: re-read every recorded buffer's address and size."""
        self.check()
        for name, get in self._getters.items():
            try:
                now = self._read(get)
            except (AttributeError, IndexError, TypeError) as exc:
                raise StaleGraphError(f"{name} was released after capture ({exc})") from exc
            if now != self.records[name]:
                raise StaleGraphError(
                    f"{name} moved from {self.records[name][0]:#x} ({self.records[name][1]} B) to {now[0]:#x} "
                    f"({now[1]} B) after capture; recapture() before replaying")
