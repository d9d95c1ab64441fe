"""LoRA training (`agentrl.train.lora`): only the adapters train, under FSDP2 too; peft loads what is saved;
checkpoints resume the adapters and their optimizer exactly; the config's two forms; SFT and `model merge`.

The tiny Qwen2 model on the CPU, fp32, a one-rank gloo group in the test process (the two-rank run is
the slow test at the end).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from agentrl.core.errors import UserError
from agentrl.rollout.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_base, is_adapter_dir
from agentrl.rollout.trajectory import Trajectory, save_trajectories
from agentrl.rollout.weight_sync import checkpoint_name
from agentrl.train import checkpoint
from agentrl.train.config import ConfigError, LoraSettings, ModelSettings, SFTConfig, TrainConfig, load_config
from agentrl.train.lora import (
    adapter_files,
    adapter_state_dict,
    apply_lora,
    is_lora,
    load_adapter_weights,
    save_adapter,
    trainable_parameters,
)
from tests.fixtures_dist import one_rank_group  # noqa: F401  (pytest fixture)
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)

LORA = LoraSettings(rank=4, alpha=8)


def trajectories(n: int, vocab: int, seed: int = 0) -> list[Trajectory]:
    """Random token sequences, a prompt (mask 0) then action tokens (mask 1); groups of two, rewards 1 and 0."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(16, 32)
        out.append(
            Trajectory(
                task_id=f"t{i // 2}",
                group_id=f"g{i // 2}",
                token_ids=[rng.randrange(vocab) for _ in range(length)],
                loss_mask=[0] * 6 + [1] * (length - 6),
                behavior_logprobs=[0.0] * length,
                prompt_len=6,
                reward=float(i % 2 == 0),
                passed=i % 2 == 0,
                finish_reason="submitted",
                policy_version=0,
            )
        )
    return out


def vocab_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def load(model_dir: Path, lora: LoraSettings | None = LORA, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora is not None:
        torch.manual_seed(seed)  # the adapters' A matrices
        apply_lora(model, lora, model_dir)
    return model


def adapter_names(model: torch.nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters() if "lora_" in n}


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits  # [B, T, V]


def sft_steps(model, opt, batch: list[Trajectory], steps: int) -> list[float]:
    """`steps` optimizer steps of the masked token-mean NLL on one fixed batch; the loss before each."""
    from agentrl.train.sft import masked_nll_sum

    losses = []
    for _ in range(steps):
        nll, n = masked_nll_sum(model, batch, pad_id=0, device=torch.device("cpu"))
        (nll / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(nll.detach()) / n)
    return losses


# --- training ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_lora_lowers_the_loss_and_changes_only_the_adapters(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    activation_checkpointing,
) -> None:
    from agentrl.train.distributed import full_state_dict, shard_model

    model = load(tiny_model_dir)
    assert is_lora(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    shard_model(model, activation_checkpointing=activation_checkpointing)
    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-2)
    # The optimizer holds the adapters and nothing else.
    adapters = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == adapters and 0 < len(held) < len(list(model.parameters()))

    losses = sft_steps(model, opt, trajectories(4, vocab_of(tiny_model_dir)), steps=6)
    assert losses[-1] < losses[0] - 0.1, losses

    after = full_state_dict(model)
    assert after.keys() == before.keys()
    frozen = [k for k in before if "lora_" not in k]
    assert frozen and all(torch.equal(after[k], before[k]) for k in frozen)  # the base, bit for bit
    assert all(not torch.equal(after[k], before[k]) for k in before if "lora_B" in k)  # B left zero


def test_grpo_step_trains_the_adapters_of_a_sharded_model(tiny_model_dir, one_rank_group) -> None:  # noqa: F811
    from agentrl.train.distributed import full_state_dict, shard_model
    from agentrl.train.update import grpo_step

    cfg = TrainConfig(
        model={"path": str(tiny_model_dir), "lora": LORA.model_dump()}, optim={"lr": 1e-2, "mini_batches": 2}
    )
    model = load(tiny_model_dir, cfg.model.lora)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    shard_model(model, activation_checkpointing=True)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=cfg.optim.lr)
    metrics = grpo_step(model, opt, trajectories(8, vocab_of(tiny_model_dir)), cfg, one_rank_group, pad_id=0)
    assert metrics["losses/grad_norm"] > 0 and metrics["optim/updates"] == 2
    after = full_state_dict(model)
    assert all(torch.equal(after[k], before[k]) == ("lora_" not in k) for k in before if "lora_A" not in k)


# --- files: peft loads them; merged, they are a plain model --------------------------------------------


def test_a_saved_adapter_is_peft_s_and_merges_to_the_same_model(tiny_model_dir, tmp_path) -> None:  # noqa: F811
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.cli import app

    model = load(tiny_model_dir).eval()
    with torch.no_grad():  # a trained-looking adapter: B away from its zero start
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    out = save_adapter(model, tmp_path / "adapter", tokenizer_from=tiny_model_dir)
    assert out is not None and is_adapter_dir(out)
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    assert adapter_base(out) == str(tiny_model_dir.resolve())
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["inference_mode"]) == (4, 8, True)
    assert set(config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert AutoTokenizer.from_pretrained(out).vocab_size > 0

    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, out).eval()
    assert torch.equal(logits(peft, ids), logits(model, ids))  # the same weights, the same computation

    merged = tmp_path / "merged"
    result = CliRunner().invoke(app, ["model", "merge", str(out), "--out", str(merged)])
    assert result.exit_code == 0, result.output
    assert not is_adapter_dir(merged) and (merged / "model.safetensors").is_file()
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in plain.named_parameters())
    torch.testing.assert_close(logits(plain, ids), logits(model, ids), rtol=0, atol=1e-5)
    assert AutoTokenizer.from_pretrained(merged).vocab_size > 0


def test_the_merged_push_is_the_adapted_model_as_full_weights(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
) -> None:
    """`model.lora.push: merged`: the state dict an engine takes instead of the adapter computes what the LoRA
    model computes, under the checkpoint's names (a sharded model, activation checkpointing's wrappers)."""
    from transformers import AutoModelForCausalLM

    from agentrl.train.distributed import shard_model
    from agentrl.train.lora import merged_state_dict

    model = load(tiny_model_dir).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])
    want = logits(model, ids)
    shard_model(model, activation_checkpointing=True, bf16=False)
    sd = merged_state_dict(model)
    assert not any("lora_" in k or "base_layer" in k or "checkpoint" in k for k in sd)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    missing, unexpected = plain.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)  # the tied head comes with the embeddings
    torch.testing.assert_close(logits(plain, ids), want, rtol=0, atol=1e-5)


def test_merge_refuses_bad_input_in_one_line(tiny_model_dir, tmp_path) -> None:  # noqa: F811
    from agentrl.cli import app

    def merge(*args: str) -> str:
        result = CliRunner().invoke(app, ["model", "merge", *args, "--out", str(tmp_path / "out")])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
        return lines[0]

    assert "is not a LoRA adapter directory" in merge(str(tiny_model_dir))
    orphan = tmp_path / "orphan"
    files = adapter_files(load(tiny_model_dir))
    assert files is not None
    orphan.mkdir()
    (orphan / ADAPTER_WEIGHTS).write_bytes(files[ADAPTER_WEIGHTS])
    config = json.loads(files[ADAPTER_CONFIG])
    (orphan / ADAPTER_CONFIG).write_text(
        json.dumps({**config, "base_model_name_or_path": str(tmp_path / "gone")})
    )
    said = merge(str(orphan))
    assert "gone: no such directory" in said and "--base" in said
    assert "--base" in merge(str(orphan), "--base", str(tmp_path / "gone"))
    assert not (tmp_path / "out").exists()


# --- checkpoints ----------------------------------------------------------------------------------------


def test_a_lora_checkpoint_resumes_the_adapter_and_the_optimizer_exactly(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    tmp_path,
) -> None:
    from peft import PeftModel
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from transformers import AutoModelForCausalLM

    from agentrl.train.distributed import shard_model

    batch = trajectories(4, vocab_of(tiny_model_dir))

    def sharded(seed: int):
        model = load(tiny_model_dir, seed=seed)
        model.train()
        shard_model(model, activation_checkpointing=True)  # wrapped layers: the files keep peft's names
        return model, torch.optim.AdamW(trainable_parameters(model), lr=1e-2)

    def optim_state(model, opt) -> dict:
        return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))["state"]

    model, opt = sharded(seed=0)
    sft_steps(model, opt, batch, steps=2)
    path = checkpoint.save(tmp_path, 2, model, opt, {"updates": 2}, base_model=tiny_model_dir, keep_last=2)
    assert is_adapter_dir(path) and not (path / "model.safetensors").exists()
    assert (path / "tokenizer_config.json").is_file() and checkpoint.latest_resumable(tmp_path) == path

    other, other_opt = sharded(seed=1)  # other A matrices, a fresh optimizer
    state = checkpoint.load(path, other, other_opt)
    assert state["step"] == 2 and state["updates"] == 2
    saved, restored = adapter_state_dict(model), adapter_state_dict(other)
    assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)
    a, b = optim_state(model, opt), optim_state(other, other_opt)
    assert a.keys() == b.keys() == {checkpoint_name(k) for k in adapter_names(model)}  # FQNs: no wrappers
    for name in a:
        assert a[name].keys() == b[name].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
    # The next step is the same step.
    assert sft_steps(model, opt, batch, 1) == sft_steps(other, other_opt, batch, 1)
    saved, restored = adapter_state_dict(model), adapter_state_dict(other)
    assert all(torch.equal(saved[k], restored[k]) for k in saved)

    # The checkpoint is an adapter peft loads, onto the base the config names.
    base = AutoModelForCausalLM.from_pretrained(adapter_base(path), dtype=torch.float32)
    assert set(PeftModel.from_pretrained(base, path).peft_config) == {"default"}

    # Another rank, or full fine-tuning, cannot resume it: said in one line.
    with pytest.raises(UserError, match=r"another LoRA rank\?"):
        load_adapter_weights(load(tiny_model_dir, LoraSettings(rank=8)), path)
    with pytest.raises(UserError, match="does not fit this model.s adapters"):
        load_adapter_weights(load(tiny_model_dir, LoraSettings(rank=4, target_modules=["q_proj"])), path)
    plain = load(tiny_model_dir, lora=None)
    with pytest.raises(UserError, match="holds a LoRA adapter, but this run trains with full fine-tuning"):
        checkpoint.load(path, plain, torch.optim.AdamW(plain.parameters()))


# --- the config -----------------------------------------------------------------------------------------


def test_model_is_a_directory_or_a_mapping_with_lora(tmp_path) -> None:
    assert TrainConfig(model="runs/sft").model == ModelSettings(path="runs/sft", lora=None)
    assert SFTConfig(model=Path("m"), data="d", out="o").model.path == "m"
    cfg = TrainConfig.model_validate({"model": {"path": "m", "lora": {}}})
    assert cfg.model.lora == LoraSettings(rank=16, alpha=32, dropout=0.0, target_modules="all-linear")
    for field in LoraSettings.model_fields.values():
        assert field.description
    # What the run directory records loads back the same, and a resume compares equal.
    again = TrainConfig.model_validate_json(cfg.model_dump_json())
    assert again == cfg
    assert (
        checkpoint.config_changes(json.loads(cfg.model_dump_json()), json.loads(again.model_dump_json()))
        == []
    )
    # A run recorded when `model` was a plain path resumes under the same path, and not with LoRA.
    old = {**json.loads(TrainConfig(model="m").model_dump_json()), "model": "m"}
    assert checkpoint.config_changes(old, json.loads(TrainConfig(model="m").model_dump_json())) == []
    # Switching LoRA on (or off) is one change, which a resume refuses without --force.
    lora_on = (
        "model.lora: None -> {'rank': 16, 'alpha': 32.0, 'dropout': 0.0, 'target_modules': 'all-linear', "
        "'push': 'adapter'}"
    )
    assert checkpoint.config_changes(old, json.loads(cfg.model_dump_json())) == [lora_on]
    lora_off = checkpoint.config_changes(
        json.loads(cfg.model_dump_json()), json.loads(TrainConfig(model="m").model_dump_json())
    )
    assert lora_off == [
        "model.lora: {'rank': 16, 'alpha': 32.0, 'dropout': 0.0, 'target_modules': 'all-linear', "
        "'push': 'adapter'} -> None"
    ]


def test_overrides_reach_into_model_whichever_form_the_file_used(tmp_path) -> None:
    plain, mapping = tmp_path / "plain.yaml", tmp_path / "mapping.yaml"
    plain.write_text("model: base\n")
    mapping.write_text("model: {path: base, lora: {rank: 32, target_modules: [q_proj, v_proj]}}\n")

    cfg = load_config(plain, ["model.lora.rank=8"])
    assert (cfg.model.path, cfg.model.lora) == ("base", LoraSettings(rank=8))
    assert load_config(plain, ["model.path=other"]).model == ModelSettings(path="other")
    assert load_config(plain, settings={"model": {"lora": {"alpha": 4}}}).model.lora == LoraSettings(alpha=4)
    assert load_config(mapping).model.lora.target_modules == ["q_proj", "v_proj"]
    assert load_config(mapping, ["model.path=other"]).model.lora.rank == 32  # the path alone changes
    assert load_config(mapping, ["model=other"]).model == ModelSettings(path="other")  # the whole section
    assert load_config(mapping, ["model=other", "model.lora.rank=4"]).model.lora == LoraSettings(rank=4)
    assert load_config(mapping, ["model.lora=null"]).model.lora is None


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("model.lora.rank=0", "'model.lora.rank': input should be greater than 0 (got 0)"),
        ("model.lora.dropout=1", "'model.lora.dropout': input should be less than 1"),
        ("model.lora.target_modules=q_proj", "target_modules must be all-linear or a non-empty list"),
        ("model.lora.target_modules=[]", "target_modules must be all-linear or a non-empty list"),
        ("model.lora.rnk=3", "unknown key 'model.lora.rnk'"),
        ("model=5", "model must be a checkpoint directory (model: DIR) or a mapping"),
        ("model.path=null", "'model.path': input should be a valid string"),
    ],
)
def test_a_bad_model_setting_is_one_line_naming_it(tmp_path, override, said) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model: base\n")
    with pytest.raises(ConfigError) as exc:
        load_config(config, [override])
    message = str(exc.value)
    assert "\n" not in message and said in message, message


def test_sft_takes_lora_as_an_option(tmp_path) -> None:
    from agentrl.cli import app

    result = CliRunner().invoke(app, ["sft", "--help"])
    assert "--model" in result.output and "--lora" in result.output
    bad = CliRunner().invoke(
        app, ["sft", "--model", "m", "--data", "d", "--out", str(tmp_path), "--lora", "{rank: -1}"]
    )
    lines = bad.output.strip().splitlines()
    assert bad.exit_code == 2 and len(lines) == 1 and "--lora" in lines[0] and "rank" in lines[0], bad.output


# --- SFT --------------------------------------------------------------------------------------------------


def sft_config(model_dir: Path, tmp_path: Path, out: str, **extra) -> SFTConfig:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        save_trajectories(data, trajectories(8, vocab_of(model_dir), seed=3))
    return SFTConfig(
        model={"path": str(model_dir), "lora": LORA.model_dump()},
        data=str(data),
        out=str(tmp_path / out),
        epochs=3,
        batch_size=4,
        lr=1e-2,
        warmup_steps=0,
        only_passed=False,
        **extra,
    )


def test_sft_with_lora_writes_an_adapter_directory(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    tmp_path,
    monkeypatch,
) -> None:
    from agentrl.train.sft import train_sft

    # train_sft quiets the libraries through the environment; the next test must not inherit that.
    monkeypatch.setenv("PYTHONWARNINGS", os.environ.get("PYTHONWARNINGS", ""))
    out = train_sft(sft_config(tiny_model_dir, tmp_path, "sft"))
    assert is_adapter_dir(out) and not (out / "model.safetensors").exists()
    assert (out / "tokenizer_config.json").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]
    assert SFTConfig.model_validate_json((out / "sft_config.json").read_text()).model.lora == LORA


@pytest.mark.slow
def test_lora_sft_on_two_ranks_takes_the_steps_of_one(tiny_model_dir, tmp_path) -> None:  # noqa: F811
    from safetensors.torch import load_file

    def run(cfg: SFTConfig, nproc: int) -> list[dict]:
        ranks = (
            [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        )
        proc = subprocess.run(
            [sys.executable, *ranks, "-m", "agentrl.train.sft", cfg.model_dump_json()],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]

    one = run(sft_config(tiny_model_dir, tmp_path, "one", micro_batch_size=2), 1)
    # Two ranks, and the layers recomputed in backward: neither may change a number beyond fp32 order.
    two = run(
        sft_config(tiny_model_dir, tmp_path, "two", micro_batch_size=1, activation_checkpointing=True), 2
    )
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    wa, wb = load_file(tmp_path / "one" / ADAPTER_WEIGHTS), load_file(tmp_path / "two" / ADAPTER_WEIGHTS)
    assert wa.keys() == wb.keys() and wa
    # Adam's first steps move every weight by about lr whatever the gradient's size, so a gradient that differs
    # in its 6th digit near zero can change a few updates' size: allow 5% of one step (lr 1e-2).
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=5e-4)
