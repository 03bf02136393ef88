"""dsv4.engine: generation on the paged cache, against transformers' own generate(), and `dsv4 run`.

The embedded default model (dsv4.engine.default_model) keeps the real attention geometry (head_dim 512,
rope 64, window 128, m 4, m' 128, all three layer types) with a tiny hidden size / vocab / MoE.

About transformers' generate() as the oracle: `DeepseekV4Attention` applies the CSA top-k and the
compressed-entry causality (`block_bias`) only when its `attention_mask` is a tensor (see
tests/hf_oracle.py). The default model is built with attn_implementation="eager", for which
transformers' mask builder always returns a float tensor, prefill and single-token decode alike, so
HF's generate() takes the correct path. The comparison test asserts this on every HF attention call
(`_require_float_masks`), so it can never pass by comparing against the unmasked path.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from dsv4 import KVCacheManager
from dsv4.cli import main
from dsv4.engine import Engine
from dsv4.engine.default_model import build_default_model, default_prompts
from dsv4.errors import CheckpointError, InputError, OutOfBlocksError
from dsv4.model.config import DSV4Config
from dsv4.model.fp8_weights import FP8_MODULES, BlockFP8Linear, dequantize_blocks, quantize_blocks
from dsv4.model.weights import _PREFIXES

FP32 = {"kv_format": "fp32", "indexer_format": "fp32"}


def prompts_of(*lengths: int) -> list[list[int]]:
    return default_prompts(512, lengths=lengths, seed=7)


def write_lines(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def ids_line(p: list[int]) -> str:
    return " ".join(map(str, p))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """main([...]) in-process: (exit code, stdout, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("dsv4 run:")]  # progress bar
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("dsv4: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny model's ops are far too small to share between threads; on a busy CI machine, intra-op
    threads spinning against other processes made these tests ~10x slower. Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """The default model saved with save_pretrained (safetensors)."""
    d = tmp_path_factory.mktemp("ckpt")
    build_default_model().save_pretrained(d)
    assert os.path.isfile(d / "model.safetensors")
    return str(d)


def copy_ckpt(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


# ------------------------------------------------------------------------------------------ the model
def test_default_model_is_randomised_and_all_layer_types():
    m = build_default_model()
    cfg = DSV4Config.from_hf(m.config)
    assert cfg.compress_ratios == (0, 4, 128, 4)
    assert (cfg.head_dim, cfg.rope_dim, cfg.sliding_window, cfg.csa_compression_ratio,
            cfg.hca_compression_ratio) == (512, 64, 128, 4, 128)
    sd = m.state_dict()
    assert sd["model.layers.0.self_attn.sinks"].abs().min() > 0
    assert sd["model.layers.1.self_attn.compressor.position_bias"].std() > 0.1
    assert sd["model.layers.1.self_attn.compressor.indexer.position_bias"].std() > 0.1
    assert sd["model.layers.2.self_attn.kv_norm.weight"].std() > 0.05
    assert sd["model.layers.0.attn_hc.base"].abs().min() > 0
    assert len(set(sd["model.layers.0.mlp.gate.tid2eid"][:, 0].tolist())) == m.config.n_routed_experts
    a, b = build_default_model(), build_default_model(seed=1)
    assert torch.equal(a.lm_head.weight, m.lm_head.weight) and not torch.equal(b.lm_head.weight, m.lm_head.weight)


# ------------------------------------------------------------------------------------------ the oracle
def _require_float_masks(model) -> list:
    """Make every HF attention call assert it got a float mask tensor (the path that applies CSA top-k)."""
    def hook(_mod, _args, kwargs):
        am = kwargs.get("attention_mask")
        assert isinstance(am, torch.Tensor) and am.is_floating_point(), \
            "HF attention ran without a float mask: its CSA top-k / causal block_bias would be ignored"
    return [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]


def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_generate_token_for_token():
    """fp32 weights and cache: dsv4 serves 4 prompts concurrently (chunked prefill, mixed steps) and every
    token equals HF's generate() run on each prompt alone (batch 1, its own DynamicCache). Covers prompts
    over 1,000 tokens (several CSA / HCA windows, chunks of 512) and 140 new tokens after a 24-token
    prompt (decode past the window and past the first HCA boundary)."""
    lengths, new = (1100, 300, 24, 5), [4, 8, 140, 20]
    prompts = prompts_of(*lengths)
    ref = build_default_model()
    hooks = _require_float_masks(ref)
    expected = [hf_generate(ref, p, n) for p, n in zip(prompts, new)]
    for h in hooks:
        h.remove()

    eng = Engine(build_default_model(), max_batch_tokens=512, max_requests=4, **FP32)
    res = eng.run(prompts, max_new_tokens=new)
    assert res.outputs == expected
    assert [len(o) for o in res.outputs] == new          # no early EOS: 140 new tokens really ran
    assert len(set(res.outputs[2])) > 10                 # not a constant (or short-cycle) stream
    assert res.stats.prompt_tokens == sum(lengths) and res.stats.generated_tokens == sum(new)


def test_fp8_weights_match_transformers_with_the_dequantised_weights(capsys):
    """fp8_weights=True: the attention projections DeepSeek ships in FP8 become FP8 blocks, and the greedy
    tokens equal HF's generate() on a model whose same weights were replaced by codes x scales (fp32
    cache and compute: the blocks' weights are exactly those). `dsv4 run --fp8-weights` reports it."""
    prompts, new = prompts_of(300, 24), [6, 30]
    ref = build_default_model()
    with torch.no_grad():
        for layer in ref.model.layers:
            for name in FP8_MODULES:
                mod = layer.self_attn.get_submodule(name) if _has(layer.self_attn, name) else None
                if mod is not None:
                    mod.weight.copy_(dequantize_blocks(*quantize_blocks(mod.weight)))
    hooks = _require_float_masks(ref)
    expected = [hf_generate(ref, p, n) for p, n in zip(prompts, new)]
    for h in hooks:
        h.remove()
    eng = Engine(build_default_model(), fp8_weights=True, **FP32)
    assert eng.weights.startswith("fp8 blocks")
    assert any(isinstance(m, BlockFP8Linear) for m in eng.blocks[1].modules())
    res = eng.run(prompts, max_new_tokens=new)
    assert res.outputs == expected and res.stats.weights == eng.weights
    assert Engine(build_default_model(), **FP32).weights == "dense"
    assert main(["run", "--fp8-weights", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert "fp8 blocks" in capsys.readouterr().out


def _has(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


# ------------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_loads_through_engine_and_cli(ckpt, tmp_path, capsys):
    prompts = prompts_of(150, 9)
    want = Engine(build_default_model(), **FP32).generate(prompts, max_new_tokens=6)
    eng = Engine(ckpt, **FP32)
    assert eng.tokenizer is None
    assert eng.generate(prompts, max_new_tokens=6) == want

    f = write_lines(tmp_path / "p.txt", [ids_line(prompts[0]), "", json.dumps({"ids": prompts[1]})])
    code, out, err = run_cli(capsys, "run", "--model", ckpt, "--prompts", f, "--max-new-tokens", "6",
                             "--kv-format", "fp32", "--indexer-format", "fp32", "--device", "cpu", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [r["generated_ids"] for r in doc["per_request"]] == want
    assert doc["requests"] == 2 and doc["rejected"] == 0 and doc["generated_tokens"] == 12


def _to_deepseek_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' names -> DeepSeek's own checkpoint names (experts unfused), the inverse of HF's conversion."""
    attn = sorted(((new, old) for old, new in _PREFIXES), key=lambda p: -len(p[0]))
    top = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
           "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    rest_map = [("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
                ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
                ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
                ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"), ("mlp.gate.", "ffn.gate."),
                ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm."),
                ("attn_hc.", "hc_attn_"), ("ffn_hc.", "hc_ffn_")]
    out = {}
    for k, v in sd.items():
        if k in top:
            out[top[k]] = v
            continue
        i, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.*)", k).groups()
        p = f"layers.{i}."
        if rest.startswith("self_attn."):
            r = rest.removeprefix("self_attn.")
            r = next((old + r[len(new):] for new, old in attn if r.startswith(new)), r)
            out[p + "attn." + r] = v
        elif rest == "mlp.experts.gate_up_proj":
            w1, w3 = v.chunk(2, dim=1)
            for e in range(v.shape[0]):
                out[p + f"ffn.experts.{e}.w1.weight"], out[p + f"ffn.experts.{e}.w3.weight"] = w1[e], w3[e]
        elif rest == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out[p + f"ffn.experts.{e}.w2.weight"] = v[e]
        else:
            a, b = next((a, b) for a, b in rest_map if rest.startswith(a))
            out[p + b + rest[len(a):]] = v
    return {k: v.contiguous() for k, v in out.items()}


def test_deepseek_named_checkpoint_loads(tmp_path):
    m = build_default_model()
    d = tmp_path / "ds"
    d.mkdir()
    m.config.save_pretrained(d)
    names = _to_deepseek_names(m.state_dict())
    assert "layers.1.attn.indexer.compressor.wkv.weight" in names and "layers.0.ffn.experts.3.w2.weight" in names
    save_file(names, str(d / "model.safetensors"), metadata={"format": "pt"})
    prompts = prompts_of(140, 6)
    want = Engine(m, **FP32).generate(prompts, max_new_tokens=4)
    assert Engine(str(d), **FP32).generate(prompts, max_new_tokens=4) == want


def test_tokenizer_in_checkpoint_encodes_text_prompts(ckpt, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = copy_ckpt(ckpt, tmp_path / "tok")
    vocab = {f"w{i}": i for i in range(511)} | {"[UNK]": 511}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(d)
    f = write_lines(tmp_path / "p.txt", ["w5 w17 w300 w2", json.dumps({"text": "w9 w9 w40"}), "5 17 300 2"])
    code, out, err = run_cli(capsys, "run", "--model", d, "--prompts", f, "--max-new-tokens", "3", "--json",
                             "--device", "cpu")
    assert code == 0, err
    reqs = json.loads(out)["per_request"]
    assert [r["prompt_tokens"] for r in reqs] == [4, 3, 4]
    assert reqs[0]["generated_ids"] == reqs[2]["generated_ids"]           # text and ids give the same prompt
    assert reqs[0]["generated_text"] == " ".join(f"w{i}" for i in reqs[0]["generated_ids"])


# ------------------------------------------------------------------------------------------ errors
def _corrupt(kind: str, d: str) -> None:
    if kind == "no_config":
        os.remove(os.path.join(d, "config.json"))
    elif kind == "bad_json":
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write('{"model_type": "deepseek_v4", "hidden_size": ')
    elif kind == "not_dsv4":
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}, f)
    elif kind == "no_weights":
        os.remove(os.path.join(d, "model.safetensors"))
    elif kind == "truncated":
        p = os.path.join(d, "model.safetensors")
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) // 2)
    elif kind == "missing_weight":
        from safetensors.torch import load_file
        p = os.path.join(d, "model.safetensors")
        sd = load_file(p)
        # save_pretrained writes DeepSeek's names (transformers reverses its weight conversion on save)
        del sd[next(k for k in sd if k.startswith("model.layers.2.") and k.endswith(("attn_sink", "sinks")))]
        save_file(sd, p, metadata={"format": "pt"})


@pytest.mark.parametrize("kind,needle", [
    ("missing_dir", "no checkpoint directory"), ("no_config", "no config.json"), ("bad_json", "not valid JSON"),
    ("not_dsv4", "not DeepSeek-V4"), ("no_weights", "no *.safetensors"), ("truncated", "re-save"),
    ("missing_weight", "lacks 1 weight"),
])
def test_bad_checkpoint_is_one_line_error(ckpt, tmp_path, capsys, kind, needle):
    d = str(tmp_path / "absent") if kind == "missing_dir" else copy_ckpt(ckpt, tmp_path / "c")
    _corrupt(kind, d)
    code, out, err = run_cli(capsys, "run", "--model", d, "--device", "cpu")
    assert_one_line_error(code, err, needle)
    assert out == ""
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        Engine(d)


def test_too_long_prompt_is_refused_and_generation_stops_at_max_position(ckpt, tmp_path, capsys):
    eng = Engine(build_default_model(max_position_embeddings=300), **FP32)
    with pytest.raises(InputError, match=r"prompt 1 has 301 tokens .* at most 300 .*shorten"):
        eng.generate([[5, 6], [3] * 301], max_new_tokens=2)
    # positions 0..299 exist: a 298-token prompt feeds 2 of its new tokens, so it gets 3 in all
    res = eng.run([[3] * 298, [4] * 5], max_new_tokens=10)
    assert [len(o) for o in res.outputs] == [3, 10] and res.finish_reasons == ["max_position", "length"]
    d = copy_ckpt(ckpt, tmp_path / "short")
    cfg_path = tmp_path / "short" / "config.json"
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()) | {"max_position_embeddings": 300}))
    f = write_lines(tmp_path / "p.txt", ["5 6", ids_line([3] * 301)])
    code, _, err = run_cli(capsys, "run", "--model", d, "--prompts", f, "--device", "cpu")
    assert_one_line_error(code, err, "301 tokens", "shorten")


def _memory_for_blocks(num_blocks: int, max_requests: int) -> int:
    """--memory that gives exactly num_blocks (null block included) with fp32 formats."""
    probe = KVCacheManager(DSV4Config.from_hf(build_default_model().config), max_requests=max_requests,
                           num_blocks=2, **FP32)
    return probe.state_bytes_per_request * max_requests + num_blocks * probe.block_bytes


def test_request_larger_than_cache_is_rejected_others_served(tmp_path, capsys):
    prompts = prompts_of(1100, 10, 30)          # 1100 + 3 tokens need 5 blocks of 256; the cache has 2
    eng = Engine(build_default_model(), num_blocks=3, max_requests=2, **FP32)
    res = eng.run(prompts, max_new_tokens=4)
    want = Engine(build_default_model(), **FP32).generate(prompts[1:], max_new_tokens=4)
    assert res.outputs == [[], *want]
    assert res.finish_reasons == ["rejected", "length", "length"]
    assert "needs 5 cache blocks" in res.rejected[0] and res.stats.rejected == 1
    assert eng.manager.allocator.num_free == 2 and not eng.manager.requests   # everything released
    with pytest.raises(OutOfBlocksError, match="no request fits"):
        eng.generate(prompts[:1], max_new_tokens=4)

    f = write_lines(tmp_path / "p.txt", [ids_line(p) for p in prompts])
    mem = str(_memory_for_blocks(3, 2))
    common = ("run", "--prompts", f, "--max-new-tokens", "4", "--kv-format", "fp32", "--indexer-format", "fp32",
              "--device", "cpu", "--max-requests", "2", "--memory", mem)
    code, out, err = run_cli(capsys, *common, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["rejected"] == 1 and doc["per_request"][0]["finish_reason"] == "rejected"
    assert [r["generated_ids"] for r in doc["per_request"][1:]] == want
    code, out, err = run_cli(capsys, *common)
    assert code == 0 and "1 rejected" in out and "request 0 rejected: needs 5 cache blocks" in out
    f1 = write_lines(tmp_path / "one.txt", [ids_line(prompts[0])])
    code, _, err = run_cli(capsys, *common[:2], f1, *common[3:])
    assert_one_line_error(code, err, "no request fits", "the smallest needs 5 blocks", "--memory")


def test_engine_input_errors():
    eng = Engine(build_default_model())
    for bad, match in [([], "no prompts"), ([[]], "prompt 0 is empty"), ([[1, 512]], "outside the vocabulary")]:
        with pytest.raises(InputError, match=match):
            eng.generate(bad)
    with pytest.raises(InputError, match="max_new_tokens"):
        eng.generate([[3]], max_new_tokens=0)
    with pytest.raises(InputError, match="top_p"):
        eng.generate([[3]], temperature=1.0, top_p=0.0)
    with pytest.raises(CheckpointError, match="DeepseekV4ForCausalLM"):
        Engine(torch.nn.Linear(2, 2))


def test_cli_input_errors(tmp_path, capsys):
    code, _, err = run_cli(capsys, "run", "--device", "tpu9")
    assert_one_line_error(code, err, "not a device")
    if not torch.cuda.is_available():
        code, _, err = run_cli(capsys, "run", "--device", "cuda")
        assert_one_line_error(code, err, "no CUDA device", "--device cpu")
    code, _, err = run_cli(capsys, "run", "--max-new-tokens", "0", "--device", "cpu")
    assert_one_line_error(code, err, "max_new_tokens")
    f = write_lines(tmp_path / "t.txt", ["hello world"])
    code, _, err = run_cli(capsys, "run", "--prompts", f, "--device", "cpu")
    assert_one_line_error(code, err, "no tokenizer", "token ids")
    code, _, err = run_cli(capsys, "run", "--prompts", str(tmp_path / "none.txt"), "--device", "cpu")
    assert_one_line_error(code, err, "cannot read prompts file")
    f = write_lines(tmp_path / "j.jsonl", ['{"ids": [1, 2'])
    code, _, err = run_cli(capsys, "run", "--prompts", f, "--device", "cpu")
    assert_one_line_error(code, err, "not valid JSON")


# ------------------------------------------------------------------------------------------ batching
def test_continuous_batching_respects_budget_and_matches_unbatched(monkeypatch):
    prompts = prompts_of(100, 60, 9, 30)
    want = Engine(build_default_model(), max_batch_tokens=4096, **FP32).generate(prompts, max_new_tokens=6)
    steps: list[dict[str, int]] = []
    orig = KVCacheManager.prepare_forward

    def spy(self, new_tokens):
        steps.append(dict(new_tokens))
        return orig(self, new_tokens)

    monkeypatch.setattr(KVCacheManager, "prepare_forward", spy)
    eng = Engine(build_default_model(), max_batch_tokens=48, max_requests=2, num_blocks=8, **FP32)
    res = eng.run(prompts, max_new_tokens=6)
    assert res.outputs == want
    assert all(sum(s.values()) <= 48 and len(s) <= 2 for s in steps)
    assert any(1 in s.values() and max(s.values()) > 1 for s in steps)   # a decode token next to a prefill chunk
    assert "req-2" not in steps[0] and "req-3" not in steps[0]            # two slots: the others wait
    assert not eng.manager.requests and eng.manager.allocator.num_free == 7


def test_sampling_is_seeded_per_request():
    eng = Engine(build_default_model(), **FP32)
    prompts = prompts_of(20, 7, 33)
    kw = {"max_new_tokens": 8, "temperature": 0.9, "top_p": 0.95}
    a = eng.generate(prompts, seed=3, **kw)
    assert eng.generate(prompts, seed=3, **kw) == a
    assert eng.generate(prompts, seed=4, **kw) != a
    one_at_a_time = Engine(build_default_model(), max_requests=1, **FP32)   # other neighbours, other steps
    assert one_at_a_time.generate(prompts, seed=3, **kw) == a
    greedy = eng.generate(prompts, max_new_tokens=8)
    assert eng.generate(prompts, max_new_tokens=8, temperature=1.0, top_p=1e-9, seed=5) == greedy
    stop = greedy[0][3]
    cut = eng.run(prompts[:1], max_new_tokens=8, stop_token_ids=[stop])
    assert cut.outputs[0] == greedy[0][:greedy[0].index(stop) + 1] and cut.finish_reasons == ["stop"]


def test_quantised_formats_and_bf16_run():
    prompts = prompts_of(200, 12)
    res = Engine(build_default_model(), dtype=torch.bfloat16).run(prompts, max_new_tokens=5)
    assert [len(o) for o in res.outputs] == [5, 5] and res.stats.dtype == "bfloat16"
    assert res.stats.kv_format == "fp8_ds" and res.stats.indexer_format == "mxfp4"
    assert 0 < res.stats.peak_cache_bytes_used <= res.stats.cache_bytes_allocated


def test_norms_of_older_transformers_get_the_pinned_dtype(monkeypatch):
    """transformers before 5.23 returns a bf16 model's norms in fp32 (fp32 weight times the bf16-cast
    normalised input), which its own bf16 MoE router refuses: the engine gives those norms the pinned
    release's forward, and leaves norms that already return the input's dtype alone."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    from dsv4.engine.model_runner import match_pinned_norms

    assert match_pinned_norms(Engine(build_default_model(), dtype=torch.bfloat16).model) == 0

    def before_5_23(self, hidden_states):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)

    monkeypatch.setattr(hf.DeepseekV4RMSNorm, "forward", before_5_23)
    eng = Engine(build_default_model(), dtype=torch.bfloat16)
    norm = eng.model.model.layers[0].input_layernorm
    x = torch.randn(3, norm.weight.shape[0], device=norm.weight.device).to(torch.bfloat16)
    want = (norm.weight * x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)
                                                  + norm.variance_epsilon)).to(torch.bfloat16)
    assert norm.weight.dtype == torch.float32 and torch.equal(norm(x), want)
    res = eng.run(prompts_of(30, 12), max_new_tokens=3)
    assert [len(o) for o in res.outputs] == [3, 3]


def test_dsv4_run_builtin_model_table(tmp_path, capsys):
    f = write_lines(tmp_path / "p.txt", [ids_line(p) for p in prompts_of(40, 3)])
    code, out, err = run_cli(capsys, "run", "--prompts", f, "--max-new-tokens", "3", "--device", "cpu")
    assert code == 0, err
    for needle in ("requests", "2 completed", "prompt tokens", "generated tokens", "prefill", "decode",
                   "time to first token", "peak cache used / allocated", "cache bytes per token", "built-in"):
        assert needle in out, out


def test_decode_graphs_refuse_large_expert_gathers(monkeypatch):
    """transformers' capturable experts copy each (token, expert)'s weights: past a budget the runner
    keeps decode eager and says why, instead of gathering GiBs per step (real V4 MoE sizes)."""
    from dsv4.engine import model_runner as mr
    from dsv4.engine.default_model import DEFAULT_SEED, build_default_model

    eng = Engine(build_default_model(DEFAULT_SEED), kv_format="fp32", indexer_format="fp32", num_blocks=64)
    runner = mr.ModelRunner(eng.model, eng.cfg, eng.manager)
    # per expert: gate_up [2*64, 64] + down [64, 64] fp32; 2 experts per token; batch 64
    assert runner._expert_gather_bytes(64) == 64 * 2 * (128 * 64 + 64 * 64) * 4
    monkeypatch.setattr(mr, "_MAX_EXPERT_GATHER_BYTES", 0)
    runner.use_graphs = True
    eng.manager.add_request("a")
    batch = eng.manager.prepare_forward({"a": 1})
    logits = runner._forward_graph(torch.tensor([5]), batch)
    assert logits.shape == (1, eng.vocab_size) and torch.isfinite(logits).all()
    assert not runner.use_graphs and runner.graph_status.startswith("off (transformers' capturable experts")
