"""``--kv-transfer-config`` parsing (docs/protocol.md §2)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from bidir_kv.config import ConfigError, KVTransferConfig

# docs/protocol.md §2.4, P side
P_CONFIG = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_producer",
    "engine_id": "prefill-engine-001",
    "kv_buffer_device": "cuda",
    "kv_load_failure_policy": "fail",
    "kv_connector_extra_config": {
        "bidirectional_kv_xfer": True,
        "kv_recompute_threshold": 64,
        "decoder_kv_blocks_ttl": 480,
    },
}


def test_spec_example_parses() -> None:
    cfg = KVTransferConfig.from_json(json.dumps(P_CONFIG))
    assert cfg.kv_connector == "NixlConnector"
    assert cfg.kv_role == "kv_producer"
    assert cfg.engine_id == "prefill-engine-001"
    assert cfg.kv_buffer_device == "cuda"
    assert cfg.kv_load_failure_policy == "fail"
    assert cfg.bidirectional_kv_xfer is True
    assert cfg.kv_recompute_threshold == 64
    assert cfg.decoder_kv_blocks_ttl == 480.0
    assert cfg.kv_lease_duration == 30
    assert cfg.backends == ("UCX",)
    assert cfg.enforce_handshake_compat is True


@pytest.mark.parametrize("text", [None, "", "   "])
def test_missing_config_gives_vllm_defaults(text: str | None) -> None:
    cfg = KVTransferConfig.from_json(text)
    assert cfg.bidirectional_kv_xfer is False
    assert cfg.kv_recompute_threshold == 64
    assert cfg.decoder_kv_blocks_ttl == 480.0
    assert cfg.kv_lease_duration == 30
    assert cfg.kv_load_failure_policy == "fail"
    uuid.UUID(cfg.engine_id)  # a random uuid4, like vLLM


def test_engine_id_defaults_to_a_fresh_uuid_each_time() -> None:
    a = KVTransferConfig.from_dict({})
    b = KVTransferConfig.from_dict({"engine_id": ""})
    assert a.engine_id != b.engine_id
    uuid.UUID(b.engine_id)


def test_null_extra_values_take_defaults() -> None:
    cfg = KVTransferConfig.from_dict(
        {
            "kv_connector_extra_config": {
                "kv_recompute_threshold": None,
                "bidirectional_kv_xfer": None,
            }
        }
    )
    assert cfg.kv_recompute_threshold == 64
    assert cfg.bidirectional_kv_xfer is False


def test_threshold_is_cast_to_int_and_may_be_zero_or_negative() -> None:
    def threshold(v: Any) -> int:
        return KVTransferConfig.from_dict(
            {"kv_connector_extra_config": {"kv_recompute_threshold": v}}
        ).kv_recompute_threshold

    assert threshold("128") == 128
    assert threshold(64.9) == 64
    assert threshold(0) == 0
    assert threshold(-1) == -1


@pytest.mark.parametrize(("text", "value"), [("true", True), ("False", False), ("TRUE", True)])
def test_boolean_strings(text: str, value: bool) -> None:
    cfg = KVTransferConfig.from_dict({"kv_connector_extra_config": {"bidirectional_kv_xfer": text}})
    assert cfg.bidirectional_kv_xfer is value


BAD: list[tuple[dict[str, Any], str]] = [
    ({"kv_connector": "NixlPushConnector"}, "kv_connector"),
    ({"kv_connector": "LMCacheConnectorV1"}, "kv_connector"),
    ({"kv_role": "producer"}, "kv_role"),
    ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
    ({"kv_connector_extra_config": [1]}, "kv_connector_extra_config"),
    ({"kv_connector_extra_config": {"backends": "UCX"}}, "backends"),
    ({"kv_connector_extra_config": {"backends": [1]}}, "backends"),
    ({"kv_connector_extra_config": {"decoder_kv_blocks_ttl": 0}}, "decoder_kv_blocks_ttl"),
    ({"kv_connector_extra_config": {"decoder_kv_blocks_ttl": "long"}}, "decoder_kv_blocks_ttl"),
    ({"kv_connector_extra_config": {"kv_lease_duration": 5}}, "kv_lease_duration"),
    ({"kv_connector_extra_config": {"kv_recompute_threshold": "lots"}}, "kv_recompute_threshold"),
    ({"kv_connector_extra_config": {"kv_recompute_threshold": True}}, "kv_recompute_threshold"),
    ({"kv_connector_extra_config": {"bidirectional_kv_xfer": "yes"}}, "bidirectional_kv_xfer"),
    ({"kv_connector_extra_config": {"bidirectional_kv_xfer": 1}}, "bidirectional_kv_xfer"),
    ({"kv_connector_extra_config": {"enforce_handshake_compat": []}}, "enforce_handshake_compat"),
    ({"engine_id": 7}, "engine_id"),
]


@pytest.mark.parametrize(("obj", "key"), BAD)
def test_bad_values_name_the_key(obj: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        KVTransferConfig.from_dict(obj)
    assert key in str(exc.value)


def test_not_json_and_not_an_object() -> None:
    with pytest.raises(ConfigError, match="not valid JSON"):
        KVTransferConfig.from_json("{bidirectional")
    with pytest.raises(ConfigError, match="JSON object"):
        KVTransferConfig.from_json("[1, 2]")


def test_round_trip_keeps_unknown_extra_keys() -> None:
    obj = json.loads(json.dumps(P_CONFIG))
    obj["kv_connector_extra_config"]["backends"] = ["LIBFABRIC"]
    obj["kv_connector_extra_config"]["custom_knob"] = {"a": 1}
    cfg = KVTransferConfig.from_dict(obj)
    again = KVTransferConfig.from_json(cfg.to_json())
    assert again == cfg
    out = cfg.to_dict()
    assert out["kv_connector_extra_config"]["custom_knob"] == {"a": 1}
    assert out["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]
    assert out["kv_connector_extra_config"]["kv_lease_duration"] == 30


def test_startup_log_line_is_vllms_including_the_missing_space() -> None:
    cfg = KVTransferConfig.from_dict(P_CONFIG)
    assert cfg.startup_log_line() == (
        "Bidirectional KV transfer is enabled and the kv recompute threshold is set to "
        "64 tokens.KV blocks on D are released after a TTL of 480 seconds."
    )


@pytest.mark.parametrize(("bidir", "threshold"), [(False, 64), (True, 0), (True, -5)])
def test_no_startup_line_when_off_or_threshold_disabled(bidir: bool, threshold: int) -> None:
    cfg = KVTransferConfig.from_dict(
        {
            "kv_connector_extra_config": {
                "bidirectional_kv_xfer": bidir,
                "kv_recompute_threshold": threshold,
            }
        }
    )
    assert cfg.startup_log_line() is None


def test_extra_holds_only_unknown_keys_and_typed_values_win() -> None:
    cfg = KVTransferConfig.from_dict(
        {"kv_connector_extra_config": {"kv_recompute_threshold": "32", "knob": 1}}
    )
    assert cfg.extra == {"knob": 1}
    extra_out = cfg.to_dict()["kv_connector_extra_config"]
    assert extra_out["kv_recompute_threshold"] == 32  # the typed value, not the raw string
    assert extra_out["enforce_handshake_compat"] is True
    assert KVTransferConfig.from_dict(cfg.to_dict()) == cfg


def test_unknown_top_level_keys_round_trip() -> None:
    """The AWS recipe's kv_rank / kv_parallel_size survive a parse and re-serialisation."""
    raw = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_rank": 0,
        "kv_parallel_size": 2,
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True},
    }
    out = KVTransferConfig.from_dict(raw).to_dict()
    assert out["kv_rank"] == 0 and out["kv_parallel_size"] == 2
    assert KVTransferConfig.from_dict(out).to_dict() == out
