"""LoRA in one process: the optimizer follows the adapters, user-applied peft models are taken
as they are, adapter files resume a run, and mistakes name the field to fix."""

import builtins

import pytest
import torch

import litegen
from litegen.config import LoRAConfig
from litegen.lora import apply_lora, has_adapters, train_adapters
from litegen.utils.config import MainConfig
from tests.distributed.models import PairDataset, loss_fn, make_model

peft = pytest.importorskip("peft")

TARGETS = ["mlp.0", "mlp.2", "ada"]
LORA = {"rank": 2, "alpha": 4, "target_modules": TARGETS}


def make_gen(tmp_path, **fields):
    config = {"runtime": {"device": "cpu"}, "results_dir": str(tmp_path), "exp_name": "exp"}
    return litegen.initialize(MainConfig.from_dict({**config, **fields}))


def names_in(optimizer, model) -> list[set[str]]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [{name_of[id(p)] for p in group["params"]} for group in optimizer.param_groups]


def test_adapters_join_the_param_group_of_the_weight_they_adapt():
    model = make_model()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    )
    halve = lambda step: 0.5**step  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [halve, halve])
    train_adapters(optimizer, apply_lora(model, LoRAConfig(**LORA)))
    first, second = names_in(optimizer, model)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert first == adapters and second == set()  # the biases were frozen, none adapted
    assert all(".lora_" in n for n in adapters) and len(adapters) == 2 * 3 * len(TARGETS)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    optimizer.step()  # no gradients yet: changes nothing, but schedulers expect it first
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.5e-3, 0.5e-3]


def test_an_optimizer_of_the_trainable_parameters_is_left_alone():
    model = apply_lora(make_model(), LoRAConfig(**LORA))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    before = [list(g["params"]) for g in optimizer.param_groups]
    train_adapters(optimizer, model)
    assert [list(g["params"]) for g in optimizer.param_groups] == before


def test_a_user_applied_peft_model_gets_no_second_adapter(tmp_path):
    gen = make_gen(tmp_path, optimization={"lora": {**LORA, "rank": 8}})
    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["ada"])
    model = peft.get_peft_model(make_model(), config)
    layers = [n for n, _ in model.named_modules() if n.endswith(".ada")]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = gen.prepare(model, optimizer)
    assert [n for n, _ in model.named_modules() if n.endswith(".ada")] == layers
    assert all(p.shape[0] == 2 for n, p in model.named_parameters() if "lora_A" in n)
    path = gen.save_model()
    from safetensors.torch import load_file

    keys = sorted(load_file(path))
    assert keys[0] == "transformer.blocks.0.ada.lora_A.weight", keys[:2]  # no base_model.model.


def test_resume_from_adapter_files_restores_adapters_optimizer_and_ema(tmp_path):
    gen = make_gen(
        tmp_path,
        global_batch_size=4,
        max_steps=3,
        optimization={"lora": LORA},
        ema={"enable": True, "decay": 0.5},
    )
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = gen.prepare(model, optimizer, PairDataset(12))
    for batch in loader:
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        gen.update_ema()
    path = gen.save_model(step=3)
    gen.save_optimizer(step=3)
    ema_path = gen.save_ema(step=3)
    assert (path.name, ema_path.name) == (
        "exp_step3.lora.safetensors",
        "exp_step3.ema.lora.safetensors",
    )
    trained, ema = gen.full_model_state(model), gen.full_ema_state()

    fields = {"resume_from": str(path), "ema": {"enable": True, "resume_from": str(ema_path)}}
    resumed = make_gen(tmp_path, optimization={"lora": LORA}, **fields)
    model2 = make_model()
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2, optimizer2 = resumed.prepare(model2, optimizer2)
    for name, value in resumed.full_model_state(model2).items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)
    assert len(optimizer2.state) == len(optimizer.state) > 0
    for name, value in resumed.full_ema_state().items():
        torch.testing.assert_close(value, ema[name], rtol=0, atol=0, msg=name)
    assert not torch.equal(
        ema["blocks.0.ada.lora_B.default.weight"], trained["blocks.0.ada.lora_B.default.weight"]
    )


@pytest.mark.parametrize("field", ["resume_from", "ema"])
def test_an_adapter_file_of_another_rank_names_the_file_and_the_shapes(tmp_path, field):
    gen = make_gen(tmp_path, optimization={"lora": LORA}, ema={"enable": True})
    model = make_model()
    gen.prepare(model, torch.optim.AdamW(model.parameters()))
    path = gen.save_model() if field == "resume_from" else gen.save_ema()
    gen.save_optimizer()
    other = {**LORA, "rank": 4}
    fields = {"resume_from": str(path)} if field == "resume_from" else {}
    ema = {"enable": True, **({"resume_from": str(path)} if field == "ema" else {})}
    resumed = make_gen(tmp_path, optimization={"lora": other}, ema=ema, **fields)
    with pytest.raises(
        ValueError, match=r"mlp\.0\.lora_A\.default\.weight: file \(2, \d+\) vs model \(4, \d+\)"
    ) as err:
        model = make_model()
        resumed.prepare(model, torch.optim.AdamW(model.parameters()))
    assert str(path) in str(err.value) and "optimization.lora.rank" in str(err.value)


def test_target_modules_that_match_nothing_name_the_field():
    with pytest.raises(ValueError, match=r"optimization\.lora\.target_modules \['nope'\]"):
        apply_lora(make_model(), LoRAConfig(rank=2, target_modules=["nope"]))


def test_lora_without_peft_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft":
            raise ImportError("No module named 'peft'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    with pytest.raises(ImportError, match=r"'lora' extra .*litegen-core\[lora\]"):
        apply_lora(make_model(), LoRAConfig(**LORA))


def test_models_without_adapters_are_saved_whole(tmp_path):
    gen = make_gen(tmp_path)
    model = gen.prepare(make_model())
    assert not has_adapters(model)
    assert gen.save_model().name == "exp.pth"


def test_the_lora_section_is_off_by_default_and_validated():
    assert MainConfig().optimization.lora is None
    with pytest.raises(ValueError, match=r"optimization\.lora\.target_modules': Field required"):
        MainConfig.from_dict({"optimization": {"lora": {"rank": 4}}})
    with pytest.raises(ValueError, match=r"optimization\.lora\.dropout"):
        MainConfig.from_dict({"optimization": {"lora": {**LORA, "dropout": 1.0}}})


def test_a_peft_folder_appears_complete_or_not_at_all(tmp_path, monkeypatch):
    from litegen import lora

    model = apply_lora(make_model(), LoRAConfig(**LORA))
    folder = lora.save_peft_folder(model, model.state_dict(), tmp_path / "exp.peft")
    earlier = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert sorted(earlier) == ["adapter_config.json", "adapter_model.safetensors"]

    def fail(value):
        raise OSError("No space left on device")

    monkeypatch.setattr(lora, "_json_safe", fail)  # fails after the weights are written
    with pytest.raises(OSError, match="No space"):
        lora.save_peft_folder(model, model.state_dict(), tmp_path / "exp.peft")
    with pytest.raises(OSError, match="No space"):
        lora.save_peft_folder(model, model.state_dict(), tmp_path / "new.peft")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.peft"]
