"""Another transformers than the pinned one: the run says so, and a family missing from it does not break the others.

The GPU image of 2026-12-06 shipped transformers 5.17, which has no bailing_hybrid module: every MoE run failed at
the block swap's import until the swap learned to skip families its transformers lacks.
"""
import importlib
import importlib.metadata

import pytest

from ds_ulysses_ext.moe import parallel
from engine.observe import versions


def test_pins_read_from_metadata_and_from_pyproject_agree(monkeypatch):
    from_metadata = versions.pinned()

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "requires", not_installed)
    from_pyproject = versions.pinned()
    for name in versions.CHECKED:
        assert from_metadata[name] == from_pyproject[name]
    assert from_pyproject["transformers"].count(".") == 2


def test_version_warning_names_the_library_that_differs():
    pins = {"transformers": "5.22.2", "deepspeed": "0.19.8", "torch": "2.13.0"}
    same = {"transformers": "5.22.2", "deepspeed": "0.19.8", "torch": "2.11.0+cu130"}  # torch is not checked
    assert versions.version_warning(same, pins) is None
    warning = versions.version_warning(dict(same, transformers="5.17.0"), pins)
    assert "transformers 5.17.0 (pinned 5.22.2)" in warning and "deepspeed" not in warning
    warning = versions.version_warning(dict(same, deepspeed="0.18.0"), pins)
    assert "deepspeed 0.18.0 (pinned 0.19.8)" in warning


def test_installed_reports_the_imported_transformers():
    import transformers
    assert versions.installed()["transformers"] == transformers.__version__


def _without(module_name, missing_name, monkeypatch):
    real = importlib.import_module

    def import_module(name, *args):
        if name == module_name:
            raise ModuleNotFoundError(f"No module named {missing_name!r}", name=missing_name)
        return real(name, *args)
    monkeypatch.setattr(importlib, "import_module", import_module)


def test_moe_swap_skips_a_family_the_installed_transformers_lacks(monkeypatch):
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridMoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    full, _ = parallel._hf_moe_classes()
    assert BailingHybridMoE in full and Qwen3MoeSparseMoeBlock in full
    _without("transformers.models.bailing_hybrid.modeling_bailing_hybrid", "transformers.models.bailing_hybrid",
             monkeypatch)
    blocks, _ = parallel._hf_moe_classes()
    assert BailingHybridMoE not in blocks and Qwen3MoeSparseMoeBlock in blocks
    assert len(blocks) == len(full) - 1


def test_moe_swap_raises_when_a_present_family_cannot_import_its_own_needs(monkeypatch):
    _without("transformers.models.qwen3_moe.modeling_qwen3_moe", "some_kernel_package", monkeypatch)
    with pytest.raises(ModuleNotFoundError, match="some_kernel_package"):
        parallel._hf_moe_classes()
