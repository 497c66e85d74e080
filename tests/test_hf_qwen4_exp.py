"""Qwen4-Exp (``qwen4_exp``, ``qwen4_exp_text``) is refused by name, with the blocks that
have no counterpart here (``linattn_jax.hf.unsupported``), from configs in
``transformers``' fields (``Qwen4ExpTextConfig``, ``Qwen4ExpConfig``'s ``text_config``)."""

import json

import pytest

from linattn_jax import hf


def _write(path, config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_qwen4_exp_is_refused_naming_its_missing_blocks(tmp_path):
    text = dict(model_type="qwen4_exp_text", hc_count=4, indexer_n_heads=2, ple_layer_ids=[1])
    message = (
        r"model_type 'qwen4_exp_text' \(Qwen4-Exp\) is not supported: no block here matches its "
        r"hyper-connections \(hc_count=4 residual streams\), the QSA indexer "
        r"\(indexer_n_heads=2\), per-layer n-gram embeddings \(ple_layer_ids=\[1\]\)$"
    )
    with pytest.raises(ValueError, match=message):
        hf.read_config(_write(tmp_path / "text", text))
    plain = dict(model_type="qwen4_exp", text_config=dict(hc_count=2, ple_layer_ids=[]))
    with pytest.raises(
        ValueError, match=r"'qwen4_exp' .* its hyper-connections \(hc_count=2 [^,]*$"
    ):
        hf.read_config(_write(tmp_path / "multimodal", plain))
