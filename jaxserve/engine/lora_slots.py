"""The device's LoRA adapter slots, the scheduler's side: which adapter each slot holds, and
which slots may be refilled.

Plain Python (no jax). The scheduler owns one `LoraSlots` (max_loras slots, numbered
1..max_loras; slot 0 is "no adapter", the base model's rows) and is its only writer; the step
core hands the runner the loads each step carries.

Data flow:
  admission: a waiting sequence with an adapter (`Sequence.lora`) is admitted only when
    `can_acquire` says its adapter has a slot or can get one; else the scheduler skips it
    (it keeps its place, the requests behind it go on). `acquire` pins the slot (one pin per
    RUNNING sequence using it) and, when the adapter was not in a slot, binds it to a free
    slot, or else to the least recently used one that nothing uses: no pin and no in-flight
    step whose rows read it (`held`). Such a slot is pending: the runner has not got it yet.
  end of `schedule()` -> `take_step(seqs)`: each row gets its slot (`ScheduledSeq.
    lora_slot`), the step holds the slots its rows use until its results are collected
    (`step_done`), and the step carries the pending slots its rows use as its loads
    (`SchedulerOutput.lora_loads`), which the step core hands `Runner.load_lora` before it
    dispatches the step. A pending slot no row of the step uses stays pending (its sequence
    was preempted in the same schedule), so a load is never lost; a step that never ran
    gives its loads back (`loads_lost`).
  preemption, finish, abort of a RUNNING sequence -> `release` unpins.
  unload (`forget`): the slot of a forgotten adapter is emptied as soon as nothing pins or
    holds it; sequences already queued with it still run (they re-acquire it as usual).

Why a refill never touches a slot an in-flight step reads (overlapped steps, `pipeline.py`):
a slot is refilled only by `acquire`, and only when it has no pin and no hold. Pins alone
would not be enough: a sequence leaves RUNNING (a stop seen one step late, an abort, a
preemption) while the step dispatched before still carries its row; that step holds the
slot until the step core has collected it. So the runner's load for step N+1 (issued while
step N runs) only ever writes slots step N does not read, and each row computes with the
adapter it was scheduled with. Never is an adapter in use evicted: a request whose adapter
finds every slot pinned or held waits.
"""

from __future__ import annotations

from typing import Callable, Sequence as GenericSequence

from jaxserve.engine.lora_request import LoraBinding
from jaxserve.engine.scheduled import ScheduledSeq, SchedulerOutput
from jaxserve.engine.sequence import Sequence

LoraLoad = tuple[int, LoraBinding]  # (slot, adapter the runner must load there)


class LoraSlots:
    def __init__(self, max_loras: int):
        """`max_loras` 0: LoRA is off (only base-model sequences exist)."""
        self.max_loras = max_loras
        n = max_loras + 1  # index 0 ("no adapter") is never bound
        self._binding: list[LoraBinding | None] = [None] * n
        self._pins = [0] * n  # RUNNING sequences using the slot
        self._held = [0] * n  # dispatched steps, not collected yet, whose rows use it
        self._slot_of: dict[int, int] = {}  # load_id -> slot
        self._idle: dict[int, None] = {}  # bound unpinned slots, least recently used first
        self._pending: set[int] = set()  # slots whose binding the runner has not been given
        self._forgotten: set[int] = set()  # load ids to unbind once nothing uses them
        self.num_loads = 0  # loads handed to steps (cumulative)
        # Told the load id a slot lets go (the registry drops an unloaded adapter's host copy).
        self.on_unbind: Callable[[int], None] | None = None

    # ----------------------------------------------------------------------- reads
    def slot_of(self, load_id: int) -> int:
        """The slot bound to that registration (0: none)."""
        return self._slot_of.get(load_id, 0)

    def in_slot(self, load_id: int) -> bool:
        return load_id in self._slot_of

    def binding(self, slot: int) -> LoraBinding | None:
        return self._binding[slot]

    def pins(self, slot: int) -> int:
        return self._pins[slot]

    def held(self, slot: int) -> int:
        return self._held[slot]

    def _free_slot(self) -> int | None:
        """A slot a new adapter may take: an empty one, else the least recently used bound
        one that nothing pins or holds (None: every slot is in use)."""
        for slot in range(1, self.max_loras + 1):
            if self._binding[slot] is None and not self._pins[slot] and not self._held[slot]:
                return slot
        for slot in self._idle:
            if not self._held[slot]:
                return slot
        return None

    def can_acquire(self, binding: LoraBinding) -> bool:
        return binding.load_id in self._slot_of or self._free_slot() is not None

    # ----------------------------------------------------------------------- writes
    def acquire(self, req: Sequence) -> tuple[int, bool]:
        """Pin a slot for `req`'s adapter (the caller checked `can_acquire`): (slot, whether
        the runner must load the adapter there). Sets `req.lora_slot`."""
        binding = req.lora
        if binding is None or req.lora_slot:
            return req.lora_slot, False
        slot = self._slot_of.get(binding.load_id, 0)
        load = slot == 0
        if load:
            free = self._free_slot()
            if free is None:
                raise RuntimeError(f"no slot for LoRA adapter {binding.name!r}: every one is "
                                   "in use (can_acquire was not checked)")
            slot = free
            self._unbind(slot)
            self._binding[slot] = binding
            self._slot_of[binding.load_id] = slot
            self._pending.add(slot)
        self._pins[slot] += 1
        self._idle.pop(slot, None)
        req.lora_slot = slot
        return slot, load

    def release(self, req: Sequence) -> None:
        """`req` stops running (preempted, finished, aborted): its pin goes."""
        slot, req.lora_slot = req.lora_slot, 0
        if not slot:
            return
        self._pins[slot] -= 1
        if self._pins[slot] == 0 and self._binding[slot] is not None:
            self._idle[slot] = None  # most recently used of the idle slots
            self._settle(slot)

    def take_step(self, seqs: GenericSequence[ScheduledSeq]
                  ) -> tuple[list[LoraLoad], tuple[int, ...]]:
        """A scheduled step's (loads, slots its rows use): rows get their slot, the step
        holds those slots until `step_done`."""
        used = set()
        for s in seqs:
            s.lora_slot = s.sequence.lora_slot
            used.add(s.lora_slot)
        used.discard(0)
        slots = tuple(sorted(used))
        loads = []
        for slot in slots:
            self._held[slot] += 1
            if slot in self._pending:
                self._pending.discard(slot)
                loads.append((slot, self._binding[slot]))
        self.num_loads += len(loads)
        return loads, slots  # type: ignore[return-value]

    def step_done(self, out: SchedulerOutput) -> None:
        """A step's holds go: it was collected, or it never ran (idempotent)."""
        slots, out.lora_slots = out.lora_slots, ()
        for slot in slots:
            self._held[slot] -= 1
            self._settle(slot)

    def loads_lost(self, out: SchedulerOutput) -> None:
        """A step whose loads never reached the runner: they are pending again."""
        for slot, binding in out.lora_loads:
            if self._binding[slot] is binding:
                self._pending.add(slot)
        out.lora_loads = []

    def forget(self, load_id: int) -> None:
        """An unloaded adapter: its slot empties once nothing pins or holds it."""
        self._forgotten.add(load_id)
        slot = self._slot_of.get(load_id)
        if slot is not None:
            self._settle(slot)

    def clear(self, slot: int) -> None:
        """Unbind `slot` now (its adapter could not be loaded; the sequences pinning it are
        being failed and release their pins after)."""
        self._unbind(slot)

    # ----------------------------------------------------------------------- helpers
    def _settle(self, slot: int) -> None:
        binding = self._binding[slot]
        if binding is not None and binding.load_id in self._forgotten and \
                not self._pins[slot] and not self._held[slot]:
            self._forgotten.discard(binding.load_id)
            self._unbind(slot)

    def _unbind(self, slot: int) -> None:
        old = self._binding[slot]
        self._binding[slot] = None
        self._idle.pop(slot, None)
        self._pending.discard(slot)
        if old is not None:
            del self._slot_of[old.load_id]
            if self.on_unbind is not None:
                self.on_unbind(old.load_id)
