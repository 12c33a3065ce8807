"""The owner engine's duplicate of the tensor-parallel group is made once per set of ranks and reused while it lives,
so rebuilding optimizers does not leak communicators (or gloo's threads)."""


def _duplicates(rank, world_size):
    import torch

    from megatron_muon.megatron.dist_muon import _duplicate_group

    singles = [torch.distributed.new_group([r]) for r in range(world_size)]  # tp = 1 groups, one per rank
    mine = singles[rank]
    first, again = _duplicate_group(mine), _duplicate_group(mine)
    world = _duplicate_group(torch.distributed.group.WORLD)
    checks = {
        "reused": first is again,
        "same ranks": torch.distributed.get_process_group_ranks(first) == [rank],
        "not the model's group": first is not mine,
        "world duplicate": torch.distributed.get_process_group_ranks(world) == list(range(world_size))
        and world is not torch.distributed.group.WORLD,
    }
    torch.distributed.destroy_process_group(first)  # a rebuilt layout destroyed it: the next call makes a new one
    remade = _duplicate_group(mine)
    checks["remade after destroy"] = remade is not first and torch.distributed.get_process_group_ranks(remade) == [rank]
    tensor = torch.ones(1) * (rank + 1)
    torch.distributed.all_reduce(tensor, group=world)
    checks["world duplicate works"] = tensor.item() == world_size * (world_size + 1) / 2
    for group in (*singles, remade, world):
        torch.distributed.destroy_process_group(group)
    return checks


def test_duplicate_groups_are_reused_while_they_live(rank_pool_2):
    for checks in rank_pool_2.run(_duplicates):
        assert all(checks.values()), checks
