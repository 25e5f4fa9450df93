"""The training frameworks users already have: transformers' Trainer, accelerate and Lightning,
unchanged but for one line (``remat.enable``), and the ``Remat`` wrapper where they inspect the
model."""

from __future__ import annotations

import copy
import inspect
import io

import lightning
import pytest
import remat
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB = 256


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128, use_cache=False)
    config.bos_token_id = config.eos_token_id = 0
    return GPT2LMHeadModel(config).train()


def _data(n: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(VOCAB, (48,), generator=g) for _ in range(n)]
    return [{"input_ids": r, "labels": r} for r in rows]


def _sample(batch: int = 4) -> dict[str, torch.Tensor]:
    tokens = torch.stack([row["input_ids"] for row in _data()[:batch]])
    return {"input_ids": tokens, "labels": tokens}


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)


def _trainer(model, out, **args) -> Trainer:
    defaults = dict(output_dir=str(out), max_steps=4, save_steps=2, logging_steps=1, use_cpu=True)
    return Trainer(
        model=model, args=TrainingArguments(**{**defaults, **args}), train_dataset=_data(), eval_dataset=_data(8)
    )


def test_trainer_trains_evaluates_saves_and_resumes_an_enabled_model(tmp_path) -> None:
    """With TrainingArguments' defaults (gradient clipping at 1.0) and gradient accumulation, the
    enabled model logs plain Trainer's losses, evaluates, saves checkpoints that
    ``from_pretrained`` of its class loads with its weights (the tied ones too), and resumes."""
    losses = {}
    for name in ("plain", "remat"):
        model = _gpt2()
        if name == "remat":
            assert remat.enable(model, 0.5, _sample(2)) is model
            assert type(model) is GPT2LMHeadModel
        trainer = _trainer(model, tmp_path / name, gradient_accumulation_steps=2, per_device_train_batch_size=2)
        trainer.train()
        losses[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert "eval_loss" in trainer.evaluate()
    assert len(losses["remat"]) == 4
    torch.testing.assert_close(losses["remat"], losses["plain"], rtol=1e-4, atol=0)
    assert remat.enabled(model) is not None and remat.enabled(model).plan.budget < remat.enabled(model).plan.plain_peak

    saved = GPT2LMHeadModel.from_pretrained(tmp_path / "remat" / "checkpoint-4")
    _same_weights(saved, model)
    assert saved.lm_head.weight.data_ptr() == saved.transformer.wte.weight.data_ptr()

    again = remat.enable(_gpt2(), 0.5, _sample(2))
    trainer = _trainer(again, tmp_path / "resumed", max_steps=6, per_device_train_batch_size=2)
    trainer.train(resume_from_checkpoint=str(tmp_path / "remat" / "checkpoint-4"))
    assert trainer.state.global_step == 6


def test_trainer_keeps_the_columns_the_wrapped_model_names(tmp_path) -> None:
    """Trainer keeps the data's columns that the model's forward names, read off the wrapper's
    signature (the wrapper's own ``*args, **kwargs`` would drop them all). It reads the label
    names off the model's class, which is the wrapper's: evaluation computes the loss where
    ``label_names`` are given (``remat.enable`` keeps the model's class and needs none)."""
    model = _gpt2()
    rm = remat.Remat(model, _sample(), 0.5)
    assert inspect.signature(rm.forward) == inspect.signature(model.forward)
    assert rm.config is model.config and rm.main_input_name == "input_ids"
    trainer = _trainer(rm, tmp_path, max_steps=2, save_strategy="no", per_device_train_batch_size=4)
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.state.log_history[0]["loss"] > 0
    assert "eval_loss" not in trainer.evaluate()
    trainer = _trainer(rm, tmp_path, max_steps=2, save_strategy="no", label_names=["labels"])
    assert "eval_loss" in trainer.evaluate()


@pytest.mark.parametrize("wrapped", [False, True], ids=["enabled", "wrapper"])
def test_accelerate_prepares_accumulates_and_saves_the_plain_models_files(tmp_path, wrapped: bool) -> None:
    """``accelerator.prepare``, ``accumulate``, ``backward`` and ``clip_grad_norm_`` train as with
    the plain model; ``unwrap_model(...).save_pretrained`` and ``save_model`` write the plain
    model's files."""
    results = []
    for use_remat in (False, True):
        model = _gpt2()
        runner = model
        if use_remat:
            runner = remat.Remat(model, _sample(2), 0.5) if wrapped else remat.enable(model, 0.5, _sample(2))
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(_data(8), batch_size=2)
        runner, optimizer, loader = accelerator.prepare(runner, optimizer, loader)
        for batch in loader:
            with accelerator.accumulate(runner):
                loss = runner(**batch).loss
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
        accelerator.unwrap_model(runner).save_pretrained(tmp_path / f"pretrained{use_remat}")
        accelerator.save_model(runner, tmp_path / f"model{use_remat}")
    for got, want in zip(*reversed(results)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    _same_weights(GPT2LMHeadModel.from_pretrained(tmp_path / "pretrainedTrue"), model)
    files = [load_file(tmp_path / f"model{r}" / "model.safetensors") for r in (False, True)]
    assert files[0].keys() == files[1].keys()


def test_enable_twice_raises_and_disable_restores_the_forward() -> None:
    model = _gpt2()
    remat.enable(model, 0.5, _sample())
    with pytest.raises(remat.ArgumentError, match="disable"):
        remat.enable(model, 0.5)
    assert remat.disable(model) is model and remat.enabled(model) is None and "forward" not in model.__dict__


def test_an_ema_copy_of_an_enabled_model_runs_its_own_weights() -> None:
    """``copy.deepcopy`` of an enabled model (an EMA copy, ``AveragedModel``) routes the copy's
    forward through a ``Remat`` of the copy, planned from the original's capture: the copy's
    outputs and gradients are its own weights', the original's untouched."""
    model, sample = _gpt2(), _sample(2)
    remat.enable(model, 0.5, sample)
    model(**sample).loss.backward()
    ema = torch.optim.swa_utils.AveragedModel(model).module
    plain = copy.deepcopy(_gpt2())
    with torch.no_grad():
        for p, q in zip(ema.parameters(), plain.parameters()):
            p.mul_(0.5)
            q.copy_(p)
    assert remat.enabled(ema) is not remat.enabled(model) and remat.enabled(ema).model.model is ema
    for m in (model, ema):
        m.zero_grad(set_to_none=True)
    for m in (ema, plain):
        m.eval()
        with torch.no_grad():
            logits = m(**sample).logits
        m.train()
        torch.manual_seed(1)
        m(**sample).loss.backward()
    torch.testing.assert_close(logits, plain.eval()(**sample).logits)
    for (name, p), q in zip(ema.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert all(p.grad is None for p in model.parameters())


def test_an_enabled_model_saved_whole_loads_enabled_and_trains_as_the_plain_one() -> None:
    """``torch.save`` of an enabled model (a whole-model checkpoint) keeps it enabled, with its
    budget and settings: the loaded model's forward runs through a ``Remat`` of its own, planned
    at its first training call, and its gradients are those of the plain model."""
    model, sample = _gpt2(), _sample(2)
    remat.enable(model, 0.5, sample)
    model(**sample).loss.backward()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    rm = remat.enabled(loaded)
    assert rm is not None and rm is not remat.enabled(model) and rm.model.model is loaded
    assert type(rm.model).__name__ == "GPT2LMHeadModel"
    plain = _gpt2()
    plain.load_state_dict(loaded.state_dict())
    assert inspect.signature(loaded.forward) == inspect.signature(plain.forward)
    for m in (loaded, plain):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        m(**sample).loss.backward()
    assert rm.plan is not None and rm.plan.budget < rm.plan.plain_peak
    for (name, p), q in zip(loaded.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    _same_weights(remat.disable(loaded), plain)


class _LitGPT2(lightning.LightningModule):
    """A LightningModule whose network is the plain model, ``remat.enable``'d, or wrapped."""

    def __init__(self, how: str = "plain") -> None:
        super().__init__()
        net = _gpt2()
        if how == "enable":
            remat.enable(net, 0.5, _sample(2))
        self.net = remat.Remat(net, _sample(2), 0.5) if how == "wrapper" else net
        self.losses: list[float] = []

    def training_step(self, batch: dict, index: int) -> torch.Tensor:
        loss = self.net(**batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("how", ["enable", "wrapper"])
def test_lightning_trains_and_checkpoints(tmp_path, how: str) -> None:
    """Lightning's Trainer on CPU trains the module as it trains the plain one (its losses), and
    its checkpoint loads back into a new module (the wrapper's state dict has the model's keys)."""
    losses = {}
    for name in ("plain", how):
        module = _LitGPT2(name)
        trainer = lightning.Trainer(
            accelerator="cpu", max_steps=4, default_root_dir=tmp_path / name, logger=False, enable_progress_bar=False
        )
        trainer.fit(module, torch.utils.data.DataLoader(_data(8), batch_size=2))
        losses[name] = module.losses
    torch.testing.assert_close(losses[how], losses["plain"], rtol=1e-4, atol=0)
    path = next((tmp_path / how).rglob("*.ckpt"))
    loaded = _LitGPT2.load_from_checkpoint(path, how=how)
    _same_weights(loaded, module)
