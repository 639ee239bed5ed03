import gc

import pytest

from servegate.gateway.server import GC_YOUNG_THRESHOLD, settled_heap


def test_settled_heap_freezes_start_up_objects_and_restores_the_collector() -> None:
    before = gc.get_threshold()
    with settled_heap():
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before


def test_settled_heap_restores_the_collector_when_serving_fails() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError, match="boom"), settled_heap():
        raise RuntimeError("boom")
    assert (gc.get_freeze_count(), gc.get_threshold()) == (0, before)
