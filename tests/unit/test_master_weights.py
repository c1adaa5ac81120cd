"""FP32 master weights on CPU: their state survives ``load_state_dict`` in FP32 (litegen.optim).

torch's ``Optimizer.load_state_dict`` casts floating state to each parameter's dtype, so without
LiteGen's hooks a bf16 parameter's master and moments would come back rounded to bf16.
"""

from __future__ import annotations

import copy

import torch

from litegen.optim import enable_master_weights


def make(masters: bool = True) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Three bf16 parameters in two groups; the last never gets a gradient."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3).to(torch.bfloat16)) for _ in range(3)]
    groups = [{"params": params[:1]}, {"params": params[1:], "lr": 1e-3}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    if masters:
        enable_master_weights(optimizer)
    return params, optimizer


def step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params[:2]:
        p.grad = torch.randn(p.shape, generator=generator).to(torch.bfloat16)
    optimizer.step()


def trained(steps: int = 2, masters: bool = True):
    params, optimizer = make(masters)
    for seed in range(steps):
        step(params, optimizer, seed)
    return params, optimizer


def resumed(params, optimizer) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """A fresh model and optimizer (with masters) that took ``optimizer``'s state and weights."""
    new_params, loaded = make()
    loaded.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    with torch.no_grad():
        for p, q in zip(new_params, params, strict=True):
            p.copy_(q)
    return new_params, loaded


def test_masters_and_moments_load_back_in_fp32_exactly():
    _, optimizer = trained()
    saved = copy.deepcopy(optimizer.state_dict())
    new_params, loaded = make()
    loaded.load_state_dict(saved)
    for i, p in enumerate(new_params[:2]):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            value = loaded.state[p][key]
            assert value.dtype == torch.float32, (i, key)
            assert torch.equal(value, saved["state"][i][key]), (i, key)
    assert new_params[2] not in loaded.state  # no state saved for it, and none made up


def test_training_continues_exactly_after_a_load():
    straight_params, _ = trained(steps=3)
    new_params, loaded = resumed(*trained(steps=2))
    step(new_params, loaded, seed=2)
    for p, q in zip(new_params, straight_params, strict=True):
        assert torch.equal(p, q)


def test_a_state_saved_without_masters_gets_fp32_masters_and_moments():
    new_params, loaded = resumed(*trained(masters=False))
    step(new_params, loaded, seed=2)
    for p in new_params[:2]:
        state = loaded.state[p]
        assert all(state[k].dtype == torch.float32 for k in ("master", "exp_avg", "exp_avg_sq"))
        assert torch.equal(p, state["master"].to(torch.bfloat16))


def test_an_fp32_master_beside_bf16_moments_keeps_its_fp32_value():
    _, optimizer = trained()
    saved = copy.deepcopy(optimizer.state_dict())
    for state in saved["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = state[key].to(torch.bfloat16)
    new_params, loaded = make()
    loaded.load_state_dict(copy.deepcopy(saved))
    for i, p in enumerate(new_params[:2]):
        master = loaded.state[p]["master"]
        assert master.dtype == torch.float32
        assert torch.equal(master, saved["state"][i]["master"])


def test_masters_step_with_the_implementation_adamw_would_choose(monkeypatch):
    """A group's ``foreach`` reaches torch's AdamW as it is: None lets torch choose (foreach on
    CUDA, as AdamW itself does), rather than a loop over the tensors."""
    from torch.optim.adam import adam

    import litegen.optim

    seen = []

    def recording_adam(*args, **kwargs):
        seen.append(kwargs["foreach"])
        return adam(*args, **kwargs)

    monkeypatch.setattr(litegen.optim, "adam", recording_adam)
    for foreach in (None, True, False):
        param = torch.nn.Parameter(torch.randn(4, 3).to(torch.bfloat16))
        optimizer = torch.optim.AdamW([param], lr=1e-2, foreach=foreach)
        enable_master_weights(optimizer)
        param.grad = torch.randn(4, 3).to(torch.bfloat16)
        optimizer.step()
    assert seen == [None, True, False]


def test_foreach_masters_step_as_foreach_adamw_on_fp32_copies():
    params, optimizer = make()
    for group in optimizer.param_groups:
        group["foreach"] = True
    reference = [torch.nn.Parameter(p.detach().float()) for p in params]
    groups = [{"params": reference[:1]}, {"params": reference[1:], "lr": 1e-3}]
    fp32 = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=True)
    for seed in range(3):
        step(params, optimizer, seed)
        for p, r in zip(params[:2], reference[:2], strict=True):
            r.grad = p.grad.float()
        fp32.step()
    for p, r in zip(params[:2], reference[:2], strict=True):
        assert torch.equal(optimizer.state[p]["master"], r.detach())
        assert torch.equal(p.detach(), r.detach().to(torch.bfloat16))
