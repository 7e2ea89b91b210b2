from bidir_kv.policy import pull_decision
from bidir_kv.protocol import KVTransferParams, ParamsKind


def test_miss_dict_shape() -> None:
    miss = KVTransferParams.miss()
    assert miss.kind is ParamsKind.MISS
    assert miss.to_dict() == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def test_threshold_equal_pulls() -> None:
    d = pull_decision(
        prompt_tokens=516, local_hit_tokens=128, remote_num_tokens=192, block_size=128, threshold=64
    )
    assert d.pull and d.tokens == 64
