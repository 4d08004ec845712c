"""NVIDIA NeMo 2 checkpoints of Megatron GPT models, read without NeMo: a folder holding
``context/`` (the model's config, ``model.yaml``, and its tokenizer) and ``weights/`` (a
megatron-core ``torch_dist`` save whose keys carry NeMo's ``module.`` prefix, its layers
stacked). The weights are read as Megatron's ``torch_dist`` (``megatron.py``), and the config's
fields, megatron-core's ``TransformerConfig`` names, become the Megatron args the packs read.
NeMo's layout, from its source (nemo/lightning/ckpt_utils.py ``WEIGHTS_PATH``/
``CONTEXT_PATH``, megatron_parallel.py's ``module.`` prefix, io/mixin.py's ``model.yaml``).
"""

from __future__ import annotations

import re
from typing import Any

from ckptkit.errors import FormatError, UsageError
from ckptkit.formats.folders.megatron import MegatronDistSource, MegatronSave
from ckptkit.storage.location import Location, local_path
from ckptkit.storage.small import read_small

__all__ = ["find_nemo2", "NeMo2Source"]

CONTEXT, WEIGHTS, CONFIG = "context", "weights", "model.yaml"
_MOST_CONFIG = 1024 * 1024  # a model's config is kilobytes
# TransformerConfig fields that are Megatron's args of the same name.
_SAME_NAMES = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "kv_channels",
    "layernorm_epsilon",
    "rotary_base",
    "rotary_interleaved",
    "make_vocab_size_divisible_by",
    "vocab_size",
    "position_embedding_type",
    "add_bias_linear",
    "add_qkv_bias",
    "normalization",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "moe_router_topk_scaling_factor",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
)
_TORCH_DTYPE = re.compile(r"torch\.(float32|float16|bfloat16|float|half)")


def find_nemo2(path: Location) -> bool:
    """Whether ``path`` is a NeMo 2 checkpoint: ``context/`` beside a ``weights/`` save."""
    if not path.is_dir():
        return False
    folder = local_path(path)
    return (folder / CONTEXT).is_dir() and (folder / WEIGHTS / ".metadata").is_file()


class NeMo2Source(MegatronDistSource):
    """A NeMo 2 checkpoint's weights, one tensor per layer in Megatron's names, its config as
    Megatron's args (so ``--map megatron-llama`` and the rest read it); an HF tokenizer in
    ``context/nemo_tokenizer`` goes beside a Hugging Face output."""

    def __init__(
        self, path: Location, *, select: str | None = None, allowed: tuple[str, ...] = ()
    ) -> None:
        folder = local_path(path)
        args = nemo_args(folder / CONTEXT / CONFIG)
        reason = f"{WEIGHTS}/ of a NeMo 2 checkpoint, its settings from {CONTEXT}/{CONFIG}"
        save = MegatronSave(path / WEIGHTS, reason, "torch_dist")
        super().__init__(save, select=select, allowed=allowed, args=args, prefix="module.")
        self.path = path
        self.format = "nemo 2"
        tokenizer = folder / CONTEXT / "nemo_tokenizer"
        if tokenizer.is_dir():
            self.config_folder = tokenizer


def nemo_args(file: Any) -> dict[str, Any]:
    """The model's config in ``context/model.yaml`` (NeMo's Hydra-style dump of its
    ``GPTConfig``) as the Megatron args of the same meaning.

    Raises:
        FormatError: no config, or not a model's.
        UsageError: PyYAML is not installed.
    """
    try:
        import yaml
    except ImportError:  # NeMo installs it; ckptkit does not need it otherwise
        raise UsageError(
            f"reading {file} (NeMo's config) needs PyYAML", "pip install pyyaml"
        ) from None
    if not file.is_file():
        raise FormatError(
            f"{file} is missing: a NeMo 2 checkpoint keeps its model's config there",
            "copy the checkpoint's context folder too",
        )
    text = read_small(file, _MOST_CONFIG, "NeMo config").decode("utf-8", "replace")
    try:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # plain data only: no tags run
        document = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as exc:
        raise FormatError(f"{file} is not YAML ({str(exc)[:80]})", "copy it again") from None
    config = document.get("config") if isinstance(document, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("num_layers"), int):
        raise FormatError(
            f"{file} holds no model config (a 'config' with num_layers)",
            "is this a NeMo 2 checkpoint of a GPT model?",
        )
    # Plain values only: an alias bomb's shared lists are never walked.
    config = {k: v for k, v in config.items() if isinstance(k, str) and _plain(v)}
    args = {name: config[name] for name in _SAME_NAMES if name in config}
    tokenizer = document.get("tokenizer")
    vocab = tokenizer.get("vocab_size") if isinstance(tokenizer, dict) else None
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
        args["vocab_size"] = vocab  # the tokenizer's: the config's may be the padded rows'
    if config.get("num_moe_experts") is not None:
        args["num_experts"] = config["num_moe_experts"]
    heads, groups = config.get("num_attention_heads"), config.get("num_query_groups")
    args["num_query_groups"] = groups
    args["group_query_attention"] = groups is not None and groups != heads
    seq = config.get("seq_length")
    args["seq_length"] = args["max_position_embeddings"] = seq
    args["swiglu"] = bool(config.get("gated_linear_unit")) and _called(config, "silu")
    args["untie_embeddings_and_output_weights"] = not config.get(
        "share_embeddings_and_output_weights", True
    )
    if "scale_factor" in config:  # Llama 3.1's and 3.2's rotary scaling (Llama31Config)
        args["use_rope_scaling"] = True
        args["rope_scaling_factor"] = config["scale_factor"]
    dtype = config.get("params_dtype")
    target = dtype.get("_target_") if isinstance(dtype, dict) else None
    if isinstance(target, str) and _TORCH_DTYPE.fullmatch(target):
        args["params_dtype"] = f"<global {target}>"
    args["transformer_impl"] = "transformer_engine"  # NeMo's layer spec
    return args


def _plain(value: Any) -> bool:
    """A config value ckptkit reads: a scalar, or a ``{_target_: ...}`` record of one."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, dict) and isinstance(value.get("_target_"), str) and len(value) <= 4


def _called(config: dict[str, Any], name: str) -> bool:
    """Whether the config's activation function is ``torch.nn.functional.NAME``."""
    function = config.get("activation_func")
    target = function.get("_target_") if isinstance(function, dict) else function
    return isinstance(target, str) and target.rsplit(".", 1)[-1] == name
