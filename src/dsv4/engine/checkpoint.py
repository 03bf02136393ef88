"""Load a DeepSeek-V4 checkpoint directory (config.json + *.safetensors) through transformers.

Weight names: transformers' own (`model.layers.0.self_attn.q_a_proj.weight`, ...) or DeepSeek's
(`layers.0.attn.wq_a.weight`, `layers.0.ffn.experts.0.w1.weight`, `hc_head_fn`, `embed.weight`,
`head.weight`, ...). `DeepseekV4ForCausalLM.from_pretrained` renames DeepSeek's names itself (its
`deepseek_v4` weight conversion: attention as in DESIGN §3, experts w1/w3 -> gate_up_proj,
w2 -> down_proj, `attn_norm`/`ffn_norm` -> input/post_attention_layernorm, `hc_attn_*`/`hc_ffn_*` ->
`attn_hc`/`ffn_hc`, `gate.bias` -> `e_score_correction_bias`); the MTP layer (`mtp.*`) is ignored.
FP8-quantised DeepSeek weights need transformers' quantizer and are not handled here.

Every failure a user can cause becomes a `CheckpointError` / `ConfigError` whose message says what
to fix; a weight missing from the files is an error (transformers would silently draw it at random).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os

import torch
import transformers
from safetensors import SafetensorError

from dsv4.errors import CheckpointError, ConfigError
from dsv4.model.config import DSV4Config

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# What transformers / safetensors raise on a bad config, weight file or tokenizer.
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError, SafetensorError)


@contextlib.contextmanager
def _quiet():
    """transformers' warnings and its "Loading weights" bar off for the call, restored after."""
    old, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(old)
        if bars:
            transformers.logging.enable_progress_bar()


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def check_checkpoint_dir(path: str) -> DSV4Config:
    """Check `path` holds a DeepSeek-V4 config and safetensors weights; return its DSV4Config."""
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint directory at {path!r}: give --model a directory holding "
                              "config.json and *.safetensors (or leave --model out for the built-in model)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path!r} has no config.json: give a transformers checkpoint directory "
                              "(save_pretrained writes one)")
    try:
        with open(cfg_path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({_first_line(e)}); fix or re-save the config") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{cfg_path} holds a JSON {type(d).__name__}, not an object; re-save the config")
    model_type = d.get("model_type")
    if model_type != "deepseek_v4":
        raise CheckpointError(f"{path!r} is a {model_type or 'untyped'} model (config.json model_type "
                              f"{model_type!r}), not DeepSeek-V4: give a checkpoint with model_type 'deepseek_v4'")
    try:
        cfg = DSV4Config.from_hf(d)
    except ConfigError as e:
        raise ConfigError(f"{cfg_path}: {e}") from None
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise CheckpointError(f"{path!r} has no *.safetensors weights: save the model with "
                              "save_pretrained(..., safe_serialization=True)")
    return cfg


def load_checkpoint(path: str, dtype: torch.dtype | None = None):
    """(DeepseekV4ForCausalLM on CPU, in `dtype` or the checkpoint's own, eval mode; tokenizer or None)."""
    path = os.fspath(path)
    check_checkpoint_dir(path)
    with _quiet():
        try:
            hc = transformers.DeepseekV4Config.from_pretrained(path, local_files_only=True)
        except _LOAD_ERRORS as e:
            raise CheckpointError(f"transformers cannot read {path}/config.json ({_first_line(e)}); "
                                  "fix or re-save the config") from None
        try:
            model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
                path, config=hc, dtype=dtype if dtype is not None else "auto", local_files_only=True,
                output_loading_info=True)
        except _LOAD_ERRORS as e:  # corrupt or truncated safetensors, shape mismatches, ...
            raise CheckpointError(f"cannot load the weights in {path!r} ({_first_line(e)}); "
                                  "re-save the checkpoint") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise CheckpointError(f"{path!r} lacks {len(missing)} weight(s) of the model, e.g. {missing[0]!r}; "
                              "re-save the full checkpoint")
    if info.get("mismatched_keys"):
        name = next(iter(info["mismatched_keys"]))
        raise CheckpointError(f"{path!r}: weight {name!r} has the wrong shape for its config; re-save the checkpoint")
    return model.eval(), load_tokenizer(path)


def load_tokenizer(path: str):
    """transformers AutoTokenizer from the directory (local files only), or None if it has none."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    with _quiet():
        try:
            return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except _LOAD_ERRORS as e:
            raise CheckpointError(f"cannot load the tokenizer in {path!r} ({_first_line(e)}); fix or remove "
                                  "its tokenizer files (prompts are then token ids)") from None
