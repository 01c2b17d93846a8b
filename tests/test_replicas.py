"""Data-parallel routing and the parallel config section (no processes: fast)."""
import pytest

from minillm.config import ConfigError, EngineConfig, ParallelConfig
from minillm.parallel.replicas import LeastLoaded, replica_config


def test_least_loaded_counts_reports_plus_what_was_sent_since():
    lb = LeastLoaded(3)
    lb.report(0, 100)
    lb.report(1, 10)
    lb.report(2, 50)
    assert lb.choose([1] * 30) == 1          # 10 < 50 < 100
    assert lb.choose([2] * 30) == 1          # 10 + 30 = 40 < 50
    assert lb.choose([3] * 30) == 2          # 70 > 50
    lb.report(1, 0)                          # the report replaces what was sent since
    assert lb.choose([4] * 5) == 1


def test_ties_go_to_the_replica_that_saw_the_prompt_head():
    lb = LeastLoaded(2)
    head = list(range(64))
    assert lb.choose(head + [1]) == 0
    lb.report(0, 0)                          # idle again: both at 0
    assert lb.choose(head + [2]) == 0        # same head: replica 0 (its prefix cache)
    lb.report(0, 0)
    assert lb.choose([9] * 70) == 0          # a new head on a tie: the first replica
    assert lb.choose([8] * 70) == 1          # not a tie any more


def test_a_removed_replica_gets_nothing():
    lb = LeastLoaded(2)
    lb.remove(0)
    lb.report(1, 10**9)
    assert all(lb.choose([i]) == 1 for i in range(5))


def test_engine_in_process_decision():
    assert ParallelConfig().engine_in_process(serving=False)
    assert not ParallelConfig().engine_in_process(serving=True)
    assert not ParallelConfig(engine_process=True).engine_in_process(serving=False)
    assert ParallelConfig(engine_process=False).engine_in_process(serving=True)
    assert not ParallelConfig(data_parallel_size=2).engine_in_process(serving=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(data_parallel_size=0), "parallel.data_parallel_size=0"),
    (dict(tensor_parallel_size=True), "parallel.tensor_parallel_size=True"),
    (dict(engine_process="yes"), "parallel.engine_process='yes'"),
    (dict(distributed_timeout_s=0), "parallel.distributed_timeout_s=0"),
    (dict(data_parallel_size=2, engine_process=False), "engine_process=false is not allowed"),
])
def test_bad_parallel_values_name_the_key(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_replicas_on_the_cpu_share_it():
    cfg = EngineConfig.from_kwargs(device="cpu", data_parallel_size=2)
    assert replica_config(cfg, 1).runtime.device == "cpu"
