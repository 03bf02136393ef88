"""Memory planner (dsv4.planner) and `dsv4 plan`: the numbers, the CLI, and agreement with a real manager."""

from __future__ import annotations

import json
import math
import sys

import pytest
from conftest import tiny_config

from dsv4 import DSV4Config, KVCacheManager
from dsv4.cache.schema import blocks_needed
from dsv4.cli import main, parse_size, parse_tokens
from dsv4.errors import ConfigError, InputError, OutOfBlocksError
from dsv4.planner import compare, fit_requests, plan_memory

GiB = 2**30
MiB = 2**20
FLASH_BYTES_PER_TOKEN = 21 * (584 + 68) / 4 + 20 * 584 / 128  # 3,423 + 91.25 = 3,514.25 (DESIGN §2, §4)


def _state_bytes_by_hand(swa: int, csa: int, hca: int, *, d: int = 512, d_i: int = 128, w: int = 128) -> int:
    """fp8_ds window ring (page padded to 576 B rows) + positions + head, plus (M, S, A) fp32 accumulators."""
    ring = math.ceil(584 * w / 576) * 576 + 4 * w + 4
    csa_state = 3 * 2 * d * 4 + 3 * 2 * d_i * 4        # cur + next, main and indexer
    hca_state = 3 * 1 * d * 4                          # cur
    return (swa + csa + hca) * ring + csa * csa_state + hca * hca_state


# ------------------------------------------------------------------------------------ real models
def test_flash_bytes_per_token_matches_design():
    plan = plan_memory(DSV4Config.flash(), context=2**20, memory_bytes=80 * GiB)
    assert plan.compressed_bytes_per_token == pytest.approx(3514.25, rel=0.01)
    assert plan.compressed_bytes_per_token == FLASH_BYTES_PER_TOKEN
    by_type = {lt.attn_type: lt for lt in plan.layer_types}
    assert (by_type["swa"].layers, by_type["csa"].layers, by_type["hca"].layers) == (2, 21, 20)
    assert by_type["csa"].bytes_per_token == 3423 and by_type["hca"].bytes_per_token == 91.25
    assert plan.state_bytes_per_request == _state_bytes_by_hand(2, 21, 20) == 3_687_468
    # 1M tokens = 262,144 CSA entries = 4,096 blocks of 64 entries.
    assert plan.blocks_per_request == 4096
    assert plan.bytes_per_request == 4096 * plan.block_bytes + plan.state_bytes_per_request


def test_pro_bytes_per_token_by_hand():
    # V4-Pro: 0 SWA, 30 CSA, 31 HCA; fp8_ds entry 584 B, mxfp4 indexer key 68 B.
    by_hand = 30 * (584 + 68) / 4 + 31 * 584 / 128
    plan = plan_memory(DSV4Config.pro(), context=2**20, memory_bytes=80 * GiB)
    assert plan.compressed_bytes_per_token == pytest.approx(by_hand, rel=1e-12)
    assert {lt.attn_type: lt.layers for lt in plan.layer_types} == {"csa": 30, "hca": 31}
    assert plan.state_bytes_per_request == _state_bytes_by_hand(0, 30, 31)


def test_comparisons_flash():
    cfg = DSV4Config.flash()
    rows = {r.name: r for r in compare(cfg, plan_memory(cfg, context=2**20, memory_bytes=80 * GiB))}
    assert rows["V3.2-style"].bytes_per_token == 61 * (656 + 132) == 48068
    assert rows["V3.2-style"].max_concurrent_requests == 1              # 47 GiB per request
    assert rows["uncompressed bf16"].bytes_per_token == 43 * 512 * 2
    assert rows["dsv4 bf16"].bytes_per_token == 21 * (1024 + 256) / 4 + 20 * 1024 / 128
    assert rows["dsv4 fp8_ds+mxfp4"].max_concurrent_requests > 2 * rows["dsv4 bf16"].max_concurrent_requests - 1


# ------------------------------------------------------------------------------------ CLI
def test_cli_prints_table(capsys):
    assert main(["plan", "--model", "flash", "--context", "1048576"]) == 0
    out = capsys.readouterr().out
    assert "3,514.25" in out and "3,687,468" in out and "V3.2-style" in out


def test_cli_json_keys(capsys):
    assert main(["plan", "--model", "flash", "--context", "1048576", "--memory", "80GiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("compressed_bytes_per_token", "state_bytes_per_request", "blocks_per_request",
                "max_concurrent_requests", "bytes_per_request", "block_bytes", "layer_types", "comparisons"):
        assert key in d, key
    assert d["compressed_bytes_per_token"] == pytest.approx(3514.25, rel=0.01)
    assert d["memory_bytes"] == 80 * GiB and d["blocks_per_request"] == 4096
    assert set(d["layer_types"]) == {"swa", "csa", "hca"}
    assert [c["name"] for c in d["comparisons"]] == ["dsv4 fp8_ds+mxfp4", "dsv4 bf16", "uncompressed bf16",
                                                     "V3.2-style"]


def test_cli_model_from_checkpoint_dir(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v4", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 8,
        "compress_ratios": [0, 4, 128], "max_position_embeddings": 8192}))
    assert main(["plan", "--model", str(tmp_path), "--context", "8K", "--memory", "1GiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["compressed_bytes_per_token"] == (584 + 68) / 4 + 584 / 128
    assert d["blocks_per_request"] == 8192 // 256


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "flsh"],                                  # unknown model name
    ["plan", "--model", "{tmp}/missing"],                         # bad path
    ["plan", "--model", "{tmp}"],                                 # a directory without config.json
    ["plan", "--model", "{tmp}/bad.json"],                        # not JSON
    ["plan", "--memory", "80XB"],                                 # bad size string
    ["plan", "--memory", "80G"],                                  # ambiguous unit
    ["plan", "--tokens-per-block", "100"],                        # not a multiple of lcm(4, 128)
    ["plan", "--tokens-per-block", "0"],
    ["plan", "--context", "0"],
    ["plan", "--context", "2M"],                                  # past max_position_embeddings
    ["plan", "--context", "lots"],
    ["plan", "--kv-format", "fp4"],
    ["plan", "--max-requests", "0"],
    ["plan", "--plot", "{tmp}/no/such/dir/plot.png"],
    [],                                                           # no subcommand
])
def test_cli_user_errors_exit_2_with_one_line(argv, tmp_path, capsys):
    if any("no/such/dir" in a for a in argv):
        pytest.importorskip("matplotlib", reason="the plot path is only opened when matplotlib is installed")
    (tmp_path / "bad.json").write_text("{not json")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsv4: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_cli_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install 'dsv4[plot]')")
    path = tmp_path / "mem.png"
    assert main(["plan", "--model", "flash", "--plot", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plot"] == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--plot", str(tmp_path / "x.png")])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("dsv4: error: --plot needs matplotlib") and captured.out == ""
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("text, value", [
    ("1024", 1024), ("80GiB", 80 * GiB), ("80 GiB", 80 * GiB), ("80gib", 80 * GiB), ("80GB", 80 * 10**9),
    ("1.5KiB", 1536), ("2MiB", 2 * MiB), ("3KB", 3000), ("1TiB", 2**40), ("2TB", 2 * 10**12), ("7B", 7),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "80G", "-1GiB", "80 XiB", "1e9"])
def test_parse_size_rejects(text):
    with pytest.raises(InputError, match="bad memory size"):
        parse_size(text)


def test_parse_tokens():
    assert (parse_tokens("1M"), parse_tokens("128K"), parse_tokens("1000")) == (2**20, 2**17, 1000)
    with pytest.raises(InputError):
        parse_tokens("1.5M")


def test_planner_input_errors():
    cfg = tiny_config()
    with pytest.raises(InputError, match="context"):
        plan_memory(cfg, context=cfg.max_position_embeddings + 1, memory_bytes=MiB, tokens_per_block=32)
    with pytest.raises(ConfigError, match="tokens_per_block"):
        plan_memory(cfg, context=10, memory_bytes=MiB, tokens_per_block=24)


# ------------------------------------------------------------------------------------ agreement with the manager
TPB = 32  # tiny_config: m = 4, m' = 16, lcm 16


@pytest.mark.parametrize("kv_format, indexer_format", [("fp8_ds", "mxfp4"), ("bf16", "bf16"), ("fp32", "fp8")])
def test_plan_matches_manager_sizes(kv_format, indexer_format):
    cfg = tiny_config()
    plan = plan_memory(cfg, context=100, memory_bytes=MiB, kv_format=kv_format, indexer_format=indexer_format,
                       tokens_per_block=TPB)
    mgr = KVCacheManager(cfg, max_requests=3, num_blocks=10, kv_format=kv_format, indexer_format=indexer_format,
                         tokens_per_block=TPB)
    rep = mgr.memory_report()
    assert plan.block_bytes == mgr.block_bytes == rep["block_bytes"]
    assert plan.state_bytes_per_request == mgr.state_bytes_per_request == rep["state_bytes_per_request"]
    # What the pools really allocated (tensor bytes), not just what the manager says:
    assert rep["bytes_allocated"] == 10 * plan.block_bytes + 3 * plan.state_bytes_per_request


def test_blocks_per_request_matches_manager_token_by_token():
    cfg = tiny_config()
    mgr = KVCacheManager(cfg, max_requests=2, num_blocks=64, tokens_per_block=TPB)
    mgr.add_request("a")
    mgr.add_request("b")
    mgr.prepare_forward({"b": 37})  # a prefill chunk too
    assert len(mgr.block_ids("b")) == plan_memory(cfg, context=37, memory_bytes=MiB,
                                                  tokens_per_block=TPB).blocks_per_request
    for n in range(1, 200):
        mgr.prepare_forward({"a": 1})
        held = len(mgr.block_ids("a"))
        assert held == plan_memory(cfg, context=n, memory_bytes=MiB, tokens_per_block=TPB).blocks_per_request, n
        assert held == blocks_needed(n, TPB, 4) == mgr.blocks_needed(n)


def _admit_and_grow(mgr: KVCacheManager, count: int, context: int) -> None:
    ids = [f"r{i}" for i in range(count)]
    for rid in ids:
        mgr.add_request(rid)
    mgr.prepare_forward(dict.fromkeys(ids, context))


@pytest.mark.parametrize("context", [3, 31, 32, 100, 129, 500])
def test_max_concurrent_requests_is_what_the_manager_admits(context):
    cfg = tiny_config()
    probe = plan_memory(cfg, context=context, memory_bytes=0, tokens_per_block=TPB)
    unit = probe.state_bytes_per_request + probe.blocks_per_request * probe.block_bytes
    floor = probe.block_bytes * (1 if probe.blocks_per_request else 2)  # null block (+1 if nothing is paged)
    # Budgets just below, at, and just below the next step of k requests.
    for k, d in [(k, d) for k in (1, 2, 5) for d in (-1, 0, unit - 1)]:
        memory = floor + k * unit + d
        plan = plan_memory(cfg, context=context, memory_bytes=memory, tokens_per_block=TPB)
        r = plan.max_concurrent_requests
        assert r == (k - 1 if d < 0 else k)
        if r:
            # r requests: admitted and grown to `context`, in exactly the memory the plan says.
            mgr = KVCacheManager(cfg, max_requests=r, memory_bytes=memory, tokens_per_block=TPB)
            assert mgr.allocator.num_blocks == plan.num_blocks
            assert mgr.memory_report()["bytes_allocated"] == plan.bytes_allocated <= memory
            _admit_and_grow(mgr, r, context)
            assert mgr.memory_report()["used_blocks"] == r * plan.blocks_per_request
        # r + 1 requests do not fit: the budget is refused, or growing them to `context` runs out of blocks.
        try:
            mgr = KVCacheManager(cfg, max_requests=r + 1, memory_bytes=memory, tokens_per_block=TPB)
        except ConfigError:
            continue
        with pytest.raises(OutOfBlocksError):
            _admit_and_grow(mgr, r + 1, context)


def test_max_requests_cap_matches_manager():
    cfg = tiny_config()
    context, cap = 100, 6
    probe = plan_memory(cfg, context=context, memory_bytes=0, tokens_per_block=TPB)
    memory = cap * probe.state_bytes_per_request + (1 + 3 * probe.blocks_per_request) * probe.block_bytes + 5
    plan = plan_memory(cfg, context=context, memory_bytes=memory, tokens_per_block=TPB, max_requests=cap)
    assert plan.max_concurrent_requests == 3 and plan.max_requests == cap
    mgr = KVCacheManager(cfg, max_requests=cap, memory_bytes=memory, tokens_per_block=TPB)
    assert mgr.memory_report()["bytes_allocated"] == plan.bytes_allocated
    _admit_and_grow(mgr, 3, context)
    mgr.add_request("one more")
    with pytest.raises(OutOfBlocksError):
        mgr.prepare_forward({"one more": context})


def test_nothing_fits():
    cfg = tiny_config()
    plan = plan_memory(cfg, context=100, memory_bytes=1000, tokens_per_block=TPB)
    assert plan.max_concurrent_requests == 0 and plan.num_blocks == 0 and plan.bytes_allocated == 0
    assert fit_requests(0, block_bytes=10, state_bytes_per_request=10, blocks_per_request=1) == 0


def test_swa_only_model_has_no_blocks():
    cfg = tiny_config(compress_ratios=(0, 0, 0))
    plan = plan_memory(cfg, context=100, memory_bytes=MiB, tokens_per_block=TPB)
    mgr = KVCacheManager(cfg, max_requests=1, num_blocks=2, tokens_per_block=TPB)
    assert plan.block_bytes == mgr.block_bytes == 0 and plan.blocks_per_request == 0
    assert plan.state_bytes_per_request == mgr.state_bytes_per_request
    assert plan.max_concurrent_requests == MiB // plan.state_bytes_per_request


def test_hf_config_round_trip():
    """DSV4Config -> transformers config -> DSV4Config is the identity (flash, pro, the test models)."""
    from conftest import real_dims_config, tiny_config

    from dsv4.model.hf_config import to_hf_config

    for cfg in (DSV4Config.flash(), DSV4Config.pro(), tiny_config(), real_dims_config(),
                tiny_config(yarn_factor=1.0)):
        back = DSV4Config.from_hf(to_hf_config(cfg))
        assert back == cfg, (cfg.name, back)
