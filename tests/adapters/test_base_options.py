"""The options that choose weights (``--select``, ``--ema``, ``--variant``) reach an adapter's
base, and the safety options (``--trust``, ``--allow-global``) reach it too: an adapter holds one
set of weights, its base is what they choose in (docs/formats/adapters.md, "Options and the
base"). Real files only: a LoRA saved by peft, bases saved by torch and safetensors."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from helpers import FIXTURE_DIR, one_error
from safetensors.torch import load_file, save_file

import ckptkit
from ckptkit.adapters import AdapterOptions
from ckptkit.convert import ReadOptions, convert_checkpoint

KOHYA_LORA = FIXTURE_DIR / "adapters" / "kohya_lora.safetensors"
KOHYA_BASE = FIXTURE_DIR / "adapters" / "kohya_base.safetensors"


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(8, 8)
        self.v = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 4)


def _state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Tiny().state_dict().items()}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """A base model folder with two variants whose values differ (``model.safetensors`` and
    ``model.fp16.safetensors``), training checkpoints whose default part is not the one
    wanted, and a peft LoRA folder whose config names the folder base."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("base_options")
    plain, other = _state(0), _state(1)
    folder = root / "base"
    folder.mkdir()
    save_file(plain, folder / "model.safetensors")
    save_file({k: v.half() for k, v in other.items()}, folder / "model.fp16.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    # The default part of these is the wrong one: 'state_dict' is found by its name before
    # 'model'; 'model' before its EMA copy.
    torch.save({"state_dict": plain, "model": other}, root / "select.pt")
    torch.save({"model": plain, "model_ema": other}, root / "ema.pt")
    # A base whose pickle names a global outside torch's safe set (a Fraction beside it).
    torch.save({"model": other, "ratio": Fraction(1, 3)}, root / "global.pt")
    torch.manual_seed(2)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q", "v"], init_lora_weights=False)
    peft_model = get_peft_model(Tiny(), config)
    lora = root / "lora"
    peft_model.save_pretrained(lora)
    path = lora / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "base_model_name_or_path": "base"}))
    return {"root": root, "base": folder, "lora": lora, "plain": plain, "other": other}


def _merged_by_peft(made: dict[str, Path], weights: dict[str, torch.Tensor]) -> dict:
    """peft's own merge of the LoRA into a model holding ``weights`` (in fp32)."""
    from peft import PeftModel

    model = Tiny()
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    return PeftModel.from_pretrained(model, made["lora"]).merge_and_unload().state_dict()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _reference(run, made, src, name: str, *options: str) -> dict[str, torch.Tensor]:
    """The LoRA merged into ``src`` with ``--adapter`` (the options choose SRC's weights)."""
    result = run("convert", src, name, "--adapter", made["lora"], *options)
    assert result.exit_code == 0, result.output
    return load_file(name)


def test_variant_reaches_the_base_the_adapter_names(run, made, tmp_path):
    """`convert ADAPTER DST --variant fp16`, the base named by the adapter's config: merged
    into model.fp16.safetensors (the fp16 weights), as peft merges into them."""
    result = run("convert", made["lora"], "out.safetensors", "--variant", "fp16")
    assert result.exit_code == 0, result.output
    assert "model.fp16.safetensors of the model folder (variant fp16)" in result.stdout
    out = load_file(tmp_path / "out.safetensors")
    assert out["out.weight"].dtype == torch.float16
    assert torch.equal(out["out.weight"], made["other"]["out.weight"].half())  # untouched
    peft = _merged_by_peft(made, {k: v.half() for k, v in made["other"].items()})
    for key in ("q.weight", "v.weight"):
        assert torch.allclose(out[key].float(), peft[key], atol=2e-3), key
    reference = _reference(run, made, made["base"], "ref.safetensors", "--variant", "fp16")
    assert _same(out, reference)


def test_variant_reaches_a_base_given_with_base(run, made, tmp_path):
    """`convert ADAPTER DST --base BASE --variant fp16`, through the CLI and the library."""
    args = ["--base", made["base"], "--variant", "fp16"]
    result = run("convert", made["lora"], "cli.safetensors", *args)
    assert result.exit_code == 0, result.output
    read = ReadOptions(variant="fp16", adapters=AdapterOptions(base=str(made["base"])))
    convert_checkpoint(made["lora"], tmp_path / "api.safetensors", read=read)
    reference = _reference(run, made, made["base"], "ref.safetensors", "--variant", "fp16")
    assert _same(load_file("cli.safetensors"), reference)
    assert _same(load_file("api.safetensors"), reference)
    plain = _reference(run, made, made["base"], "plain.safetensors")
    assert not torch.equal(plain["q.weight"], reference["q.weight"].float())


def test_variant_the_base_lacks_is_the_base_folders_error(run, made):
    result = run("convert", made["lora"], "out.safetensors", "--variant", "fp8")
    one_error(result, str(made["base"]), "no variant 'fp8'", "--variant")


@pytest.mark.parametrize(("base", "option"), [("select.pt", "--select"), ("ema.pt", "--ema")])
def test_select_and_ema_reach_the_base(run, made, tmp_path, base, option):
    """`--select model` (a part the default would not take) and `--ema` choose the base's part:
    the merge equals the LoRA merged into that part, not into the default one."""
    path = made["root"] / base
    chosen = ["--select", "model"] if option == "--select" else ["--ema"]
    result = run("convert", made["lora"], "out.safetensors", "--base", path, *chosen)
    assert result.exit_code == 0, result.output
    reference = _reference(run, made, path, "ref.safetensors", *chosen)
    default = _reference(run, made, path, "default.safetensors")
    out = load_file("out.safetensors")
    assert _same(out, reference) and not _same(out, default)
    read = ReadOptions(
        select="model" if option == "--select" else None,
        ema=option == "--ema",
        adapters=AdapterOptions(base=str(path)),
    )
    convert_checkpoint(made["lora"], tmp_path / "api.safetensors", read=read)
    assert _same(load_file("api.safetensors"), reference)


def test_load_state_dict_passes_the_options_to_the_base(made):
    """The loaders open an adapter's base with their ``select=`` / ``variant=``."""
    by_select = ckptkit.load_state_dict(
        made["lora"], base=made["root"] / "select.pt", select="model"
    )
    by_variant = ckptkit.load_state_dict(made["lora"], variant="fp16")
    assert torch.equal(by_select["out.weight"], made["other"]["out.weight"])
    assert torch.equal(by_variant["out.weight"], made["other"]["out.weight"].half())
    model = Tiny()
    ckptkit.load_into(model, made["lora"], base=made["root"] / "ema.pt", select="model_ema")
    assert torch.equal(model.out.weight.detach(), made["other"]["out.weight"])


def test_allow_global_reaches_the_base(run, made):
    """The base's pickle is read with ``--allow-global`` as SRC's is (refused without it)."""
    args = [made["lora"], "out.safetensors", "--base", made["root"] / "global.pt"]
    one_error(run("convert", *args), "fractions.Fraction", "--allow-global")
    result = run("convert", *args, "--allow-global", "fractions.Fraction")
    assert result.exit_code == 0, result.output
    assert torch.equal(load_file("out.safetensors")["out.weight"], made["other"]["out.weight"])


def test_kohya_file_with_base_takes_the_base_options(run, tmp_path):
    """A kohya LoRA file SRC with ``--base``: ``--variant`` picks the base folder's weights (a
    file holds no variants), where it was refused as a variant of the LoRA file."""
    folder = tmp_path / "kohya_base"
    folder.mkdir()
    state = load_file(KOHYA_BASE)
    save_file(state, folder / "model.safetensors")
    save_file({k: v * 2 for k, v in state.items()}, folder / "model.fp16.safetensors")
    args = ["--base", folder, "--variant", "fp16"]
    result = run("convert", KOHYA_LORA, "out.safetensors", *args)
    assert result.exit_code == 0, result.output
    result = run(
        "convert", folder / "model.fp16.safetensors", "ref.safetensors", "--adapter", KOHYA_LORA
    )
    assert result.exit_code == 0, result.output
    assert _same(load_file("out.safetensors"), load_file("ref.safetensors"))


def test_base_given_for_a_model_still_refused(run, made):
    """``--base`` with a SRC that is not an adapter: the one error it always gave, whatever
    chooses weights beside it."""
    args = [made["root"] / "select.pt", "out.safetensors", "--base", made["base"]]
    one_error(run("convert", *args, "--select", "model"), "not an adapter", "--base does not apply")


def test_kohya_file_into_one_component_of_a_pipeline_base(run, tmp_path):
    """`convert LORA DST --base PIPELINE --select unet`: the LoRA's UNet part merged into the
    pipeline's UNet, as `convert PIPELINE DST --select unet --adapter LORA` merges it."""
    pipeline = FIXTURE_DIR / "diffusers" / "pipeline"
    gen = torch.Generator().manual_seed(0)
    unet_q = "down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    lora = {
        f"lora_unet_{unet_q}.lora_down.weight": torch.randn([2, 4], generator=gen),
        f"lora_unet_{unet_q}.lora_up.weight": torch.randn([4, 2], generator=gen),
        f"lora_unet_{unet_q}.alpha": torch.tensor(1.0),
    }
    save_file(lora, tmp_path / "sd_lora.safetensors")
    args = ["--base", pipeline, "--select", "unet"]
    result = run("convert", "sd_lora.safetensors", "out.safetensors", *args)
    assert result.exit_code == 0, result.output
    args = ["--select", "unet", "--adapter", "sd_lora.safetensors"]
    result = run("convert", pipeline, "ref.safetensors", *args)
    assert result.exit_code == 0, result.output
    assert _same(load_file("out.safetensors"), load_file("ref.safetensors"))


def test_base_for_a_peft_model_state_dict_refused(run, made):
    """A PeftModel state dict holds its base: ``--base`` beside it is refused, not ignored."""
    full = FIXTURE_DIR / "adapters" / "bert_peft_full.pt"
    args = [full, "out.safetensors", "--drop-adapters", "--base", made["base"]]
    one_error(run("convert", *args), "PeftModel state dict", "drop --base")


def test_base_for_a_pipeline_component_is_still_not_an_adapter(run, made):
    """A local folder is told by its files: a pipeline's component chosen with ``--select``,
    then ``--base`` refused for it, as before."""
    pipeline = FIXTURE_DIR / "diffusers" / "pipeline"
    args = [pipeline, "out.safetensors", "--select", "unet", "--base", made["base"]]
    one_error(run("convert", *args), "not an adapter", "--adapter PATH")
