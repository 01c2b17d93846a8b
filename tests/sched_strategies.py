"""Hypothesis strategies and a scheduler factory shared by the scheduler and input-builder property tests."""
from hypothesis import strategies as st

from minillm.config import CacheConfig, SchedulerConfig
from minillm.engine.scheduler import Scheduler


def scheduler_configs(num_blocks: tuple[int, int], budget: tuple[int, int], max_num_seqs: tuple[int, int],
                      thresholds: list[int]) -> st.SearchStrategy:
    """Random scheduler settings: pool size, step budget, batch cap, long-prefill threshold, chunking, policy
    and prefix caching."""
    return st.fixed_dictionaries({
        "num_blocks": st.integers(*num_blocks),
        "budget": st.integers(*budget),
        "max_num_seqs": st.integers(*max_num_seqs),
        "threshold": st.sampled_from(thresholds),
        "chunked": st.booleans(),
        "policy": st.sampled_from(["fcfs", "priority", "static"]),
        "caching": st.booleans(),
    })


def scripts(requests: st.SearchStrategy, max_size: int, step_weight: int = 1) -> st.SearchStrategy:
    """Lists of ("add", request), ("step", seed) and ("abort", index) operations; step_weight > 1 makes steps
    that much more likely than the others (long runs of decodes)."""
    step = st.tuples(st.just("step"), st.integers(0, 2**31))
    return st.lists(st.one_of(st.tuples(st.just("add"), requests), *[step] * step_weight,
                              st.tuples(st.just("abort"), st.integers(0, 40))), max_size=max_size)


def make_scheduler(cfg: dict, block_size: int, max_model_len: int, cls=Scheduler) -> Scheduler:
    return cls(
        SchedulerConfig(max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["budget"],
                        enable_chunked_prefill=cfg["chunked"], long_prefill_token_threshold=cfg["threshold"],
                        policy=cfg["policy"]),
        CacheConfig(block_size=block_size, enable_prefix_caching=cfg["caching"]), cfg["num_blocks"], max_model_len)
