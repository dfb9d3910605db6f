"""A daemon's model loads beside its serving loop (kvd.server.model_loading): while one runs, the interpreter's lock
changes hands every LOAD_SWITCH_S and no full collection runs; both are as they were after, a failed load too.
(benchmarks/multi_model.py measures what this buys a stream: its longest gap while another model loads.)"""

from __future__ import annotations

import gc
import sys

import pytest

from kvd.server.model_loading import LOAD_SWITCH_S, _beside_the_loop


def test_a_load_hands_the_lock_over_often_and_defers_full_collections():
    interval, threshold = sys.getswitchinterval(), gc.get_threshold()
    with _beside_the_loop():
        assert sys.getswitchinterval() == pytest.approx(LOAD_SWITCH_S)
        assert gc.get_threshold()[:2] == threshold[:2] and gc.get_threshold()[2] > 1_000_000
    assert (sys.getswitchinterval(), gc.get_threshold()) == (interval, threshold)


def test_a_failed_load_leaves_them_as_they_were():
    interval, threshold = sys.getswitchinterval(), gc.get_threshold()
    with pytest.raises(RuntimeError, match="no such model"), _beside_the_loop():
        raise RuntimeError("no such model")
    assert (sys.getswitchinterval(), gc.get_threshold()) == (interval, threshold)
