"""Reading and validating Hugging Face Llama checkpoints, and cutting them into rank files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.backends.torch.checkpoint import check_checkpoint, write_rank_shards
from app.errors import ArtifactError, ConfigError
from app.llama import read_llama_config

from .helpers import build_artifact, load_backend


@pytest.fixture
def stories_copy(stories260k: Path, tmp_path: Path) -> Path:
    """A writable copy of stories260K's config and weights."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(stories260k / name, model / name)
    return model


def edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_tensors(model_dir: Path, drop: str | None = None, reshape: str | None = None) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    save_file(tensors, path)


def test_reads_the_stories_config(stories260k: Path) -> None:
    spec = read_llama_config(stories260k)
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        64,
        5,
        8,
        4,
        8,
    )
    assert (spec.vocab_size, spec.intermediate_size, spec.max_position_embeddings) == (512, 172, 512)
    assert spec.tie_word_embeddings and spec.rope_scaling is None
    assert (spec.rope_theta, spec.rms_norm_eps, spec.eos_token_ids) == (10000.0, 1e-5, (2,))


def test_reads_transformers_4_rope_fields(stories_copy: Path) -> None:
    edit_config(stories_copy, rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 4.0})
    spec = read_llama_config(stories_copy)
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling is not None
    assert (spec.rope_scaling.rope_type, spec.rope_scaling.factor) == ("linear", 4.0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "not a Llama checkpoint"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_unsupported_configs_get_one_clear_error(stories_copy: Path, changes: dict, message: str) -> None:
    edit_config(stories_copy, **changes)
    with pytest.raises(ConfigError, match=message):
        check_checkpoint(stories_copy)


def test_a_missing_tensor_is_named(stories_copy: Path) -> None:
    edit_tensors(stories_copy, drop="model.layers.3.mlp.up_proj.weight")
    with pytest.raises(ConfigError, match=r"missing 1 tensor\(s\): model.layers.3.mlp.up_proj.weight"):
        check_checkpoint(stories_copy)


def test_a_misshaped_tensor_is_named(stories_copy: Path) -> None:
    edit_tensors(stories_copy, reshape="model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(
        ConfigError, match=r"model.layers.1.self_attn.k_proj.weight has shape \[31, 64\], expected"
    ):
        check_checkpoint(stories_copy)


def test_untied_checkpoints_need_an_lm_head(stories_copy: Path) -> None:
    edit_config(stories_copy, tie_word_embeddings=False)
    with pytest.raises(ConfigError, match=r"lm_head\.weight"):
        check_checkpoint(stories_copy)


def test_a_folder_without_safetensors_is_refused(stories_copy: Path) -> None:
    (stories_copy / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        check_checkpoint(stories_copy)


def test_sharded_checkpoints_give_the_same_rank_files(stories_copy: Path, tmp_path: Path) -> None:
    single = write_rank_shards(stories_copy, tmp_path / "single", 2, "fp32", check_checkpoint(stories_copy))
    tensors = load_file(stories_copy / "model.safetensors")
    names = sorted(tensors)
    halves = {"part-1.safetensors": names[::2], "part-2.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({name: tensors[name] for name in part}, stories_copy / file)
    weight_map = {name: file for file, part in halves.items() for name in part}
    (stories_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (stories_copy / "model.safetensors").unlink()
    sharded = write_rank_shards(stories_copy, tmp_path / "sharded", 2, "fp32", check_checkpoint(stories_copy))
    for one, other in zip(single, sharded, strict=True):
        a, b = load_file(one), load_file(other)
        assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_rank_files_hold_only_their_slices(stories260k: Path, tmp_path: Path) -> None:
    paths = write_rank_shards(stories260k, tmp_path, 2, "bf16", check_checkpoint(stories260k))
    assert [path.name for path in paths] == ["rank-0.safetensors", "rank-1.safetensors"]
    source = load_file(stories260k / "model.safetensors")
    rank1 = load_file(paths[1])
    q = source["model.layers.0.self_attn.q_proj.weight"]  # 8 heads x 8 dims: rank 1 holds heads 4..7
    assert rank1["layers.0.qkv_proj"].shape == (32 + 16 + 16, 64)
    assert torch.equal(rank1["layers.0.qkv_proj"][:32], q[32:].to(torch.bfloat16))
    assert torch.equal(rank1["embed_tokens"], source["model.embed_tokens.weight"][256:].to(torch.bfloat16))
    assert rank1["layers.0.down_proj"].shape == (64, 86)
    assert "lm_head" not in rank1  # tied: the runtime reuses the embedding slice


def test_sizes_not_divisible_by_tp_are_refused(stories260k: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="num_attention_heads 8 is not divisible by tp_degree 3"):
        write_rank_shards(stories260k, tmp_path, 3, "fp32", check_checkpoint(stories260k))


def test_rank_files_of_another_tp_degree_are_refused(stories260k: Path, tmp_path: Path) -> None:
    artifact = build_artifact(stories260k, tmp_path, tp_degree=2)
    with pytest.raises(ArtifactError, match=r"rank-0\.safetensors was written for"):
        load_backend(artifact, tp_degree=1)
