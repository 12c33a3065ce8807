"""Re-initializing megatron's parallel state in one process destroys the process groups of the layout it replaces
(megatron's own teardown forgets them, and each gloo group keeps threads alive)."""


def _reinitialize(rank, world_size):
    from megatron_muon.distributed.process_groups import is_alive, live_groups
    from megatron_muon.training.distributed import init_parallel_state

    before = set(live_groups())  # a pooled rank may hold other tests' groups: only this call's count
    init_parallel_state(1, 1)
    first = [group for group in live_groups() if group not in before]
    counts = []
    for tp in (2, 1, 1):
        init_parallel_state(tp, 1)
        counts.append(len(live_groups()))
    init_parallel_state(1, 1)
    return {"first layout's groups destroyed": not any(is_alive(group) for group in first),
            "same count for the same layout": counts[1] == counts[2] == len(live_groups()),
            "made groups": len(first) > 0}


def test_init_parallel_state_destroys_the_replaced_layouts_groups(rank_pool_2):
    for checks in rank_pool_2.run(_reinitialize):
        assert all(checks.values()), checks
