"""LoRA adapters: the ones the server knows, and the ones in accelerator slots.

As in vLLM, loading an adapter (at startup or through the API) only registers it;
a step that runs requests for an adapter that holds no slot brings it into one,
evicting the least recently used adapter that the step does not need. The
scheduler never lets one step need more than `max_loras` adapters.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str
    lora_id: int
    """vLLM's `lora_int_id`: 1, 2, ... in load order."""


class LoraError(Exception):
    def __init__(self, message: str, status: int, err_type: str) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type


class LoraRegistry:
    def __init__(self, max_loras: int, adapters: dict[str, str] | None = None) -> None:
        self.max_loras = max_loras
        self._adapters: dict[str, Adapter] = {}
        self._next_id = 1
        self._slots: OrderedDict[int, None] = OrderedDict()
        self.activations = 0
        for name, path in (adapters or {}).items():
            self.add(name, path)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    def adapters(self) -> list[Adapter]:
        return list(self._adapters.values())

    def add(self, name: str, path: str) -> Adapter:
        self.check_new(name, path)
        adapter = Adapter(name=name, path=path, lora_id=self._next_id)
        self._next_id += 1
        self._adapters[name] = adapter
        return adapter

    def check_new(self, name: str, path: str) -> None:
        """Raise the error `add` would raise, without adding."""
        if not name or not path:
            raise LoraError(
                "Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput"
            )
        if name in self._adapters:
            raise LoraError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                400,
                "InvalidUserInput",
            )

    def remove(self, name: str) -> Adapter:
        if not name:
            raise LoraError(
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                400,
                "InvalidUserInput",
            )
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise LoraError(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
        self._slots.pop(adapter.lora_id, None)
        return adapter

    @property
    def resident(self) -> list[int]:
        """Adapter ids in slots, least recently used first."""
        return list(self._slots)

    def activate(self, lora_ids: Iterable[int]) -> int:
        """Give every adapter of a step a slot; returns how many had to be loaded."""
        needed = list(dict.fromkeys(lora_ids))
        loaded = 0
        for lora_id in needed:
            if lora_id in self._slots:
                self._slots.move_to_end(lora_id)
                continue
            if len(self._slots) >= self.max_loras:
                for victim in self._slots:
                    if victim not in needed:
                        del self._slots[victim]
                        break
            self._slots[lora_id] = None
            loaded += 1
        self.activations += loaded
        return loaded
