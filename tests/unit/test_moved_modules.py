"""Old import paths of moved modules keep working, with a warning that names the new path."""

from __future__ import annotations

import importlib
import os
import sys
import warnings

import pytest

from litegen.utils.moved_modules import MOVED, PUBLIC_PATHS, RENAMED, moved_attribute


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_new_module_and_warns(old, monkeypatch):
    new = importlib.import_module(MOVED[old])
    if any(target.startswith(old + ".") for target in MOVED.values()):
        # The old module's name is a package now: it forwards the old module's names.
        name = next(n for n in vars(new) if not n.startswith("_"))
        with pytest.warns(DeprecationWarning, match=f"moved to {MOVED[old]}.{name}"):
            found = getattr(importlib.import_module(old), name)
        assert found is getattr(new, name)
        return
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported before: import it again
    with pytest.warns(DeprecationWarning, match=f"moved to {MOVED[old]};"):
        assert importlib.import_module(old) is new


@pytest.mark.parametrize("public", sorted(PUBLIC_PATHS))
def test_a_public_path_gives_the_module_of_its_layer_without_a_warning(public, monkeypatch):
    module = importlib.import_module(PUBLIC_PATHS[public])
    monkeypatch.delitem(sys.modules, public, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(public) is module
    root = importlib.import_module("litegen").__path__[0]
    assert not os.path.exists(os.path.join(root, *public.split(".")[1:]) + ".py")


def test_the_spec_path_of_vae_encode_imports():
    from litegen.data.vae_encode import vae_encode as where_it_lives
    from litegen.utils.encode import vae_encode

    assert vae_encode is where_it_lives


def test_a_forwarding_package_still_gives_its_submodules():
    # ``throughput`` is both a submodule of litegen.flops and a function of the old module;
    # ``from litegen.flops import throughput`` asks the package's __getattr__ first.
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        found = moved_attribute("litegen.flops", "throughput")
    assert found is importlib.import_module("litegen.flops.throughput")


def test_an_unknown_name_of_a_forwarding_package_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = importlib.import_module("litegen.flops").no_such_name


def test_the_root_holds_at_most_eight_loose_modules():
    from pathlib import Path

    import litegen

    root = Path(litegen.__file__).parent
    loose = sorted(p.name for p in root.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 8, loose
    assert not any(root.joinpath(*old.split(".")[1:]).with_suffix(".py").exists() for old in MOVED)


@pytest.mark.parametrize(
    ("module", "old"), [(module, old) for module, names in RENAMED.items() for old in names]
)
def test_an_old_name_gives_the_renamed_function_and_warns(module, old):
    found = importlib.import_module(module)
    new = RENAMED[module][old]
    with pytest.warns(DeprecationWarning, match=f"moved to {module}.{new}"):
        assert getattr(found, old) is getattr(found, new)
