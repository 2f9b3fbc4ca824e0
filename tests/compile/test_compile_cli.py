"""`inf2serve compile` and `inf2serve artifacts` end to end against a real S3 protocol server (moto, its
own process): publish, list, show, verify, promote, load through an alias and replay the golden
records on the torch backend; and every rejection happens before any work, leaving nothing behind."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from app.artifacts.golden import Golden, GoldenPrompt, replay
from app.artifacts.loader import load_artifact
from app.artifacts.manifest import MANIFEST_NAME, Manifest
from app.backends.torch import TorchBackend
from app.cli import main
from app.errors import ArtifactError
from compile import pipeline
from compile.publish import publish
from loadtest.harness.s3 import upload_tree
from tests.compile.conftest import SMALL_GRID, TINY


def run(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def keys(s3, bucket: str) -> list[str]:
    return [item["Key"] for item in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])]


def test_compile_publish_promote_and_load(s3, bucket, stories260k, capsys, tmp_path) -> None:
    code, out, err = run(
        capsys, "compile", "--model", str(stories260k), "--output", f"s3://{bucket}/art", *SMALL_GRID
    )
    assert code == 0, err
    uri = out[-1]
    assert uri.startswith(f"s3://{bucket}/art/stories260K/")
    manifest = Manifest.loads(
        s3.client().get_object(Bucket=bucket, Key=uri.split("/", 3)[3] + "/manifest.json")["Body"].read()
    )
    assert manifest.validation.passed and manifest.validation.prompts >= 3 and not manifest.random_weights
    assert manifest.spec.grid.context_buckets == (64, 128, 256) and manifest.spec.grid.num_slots == 4
    assert {entry.path for entry in manifest.files} >= {
        "golden.json",
        "model/config.json",
        "model/tokenizer.json",
        "weights/rank-0.safetensors",
    }
    golden = Golden.loads(
        s3.client().get_object(Bucket=bucket, Key=uri.split("/", 3)[3] + "/golden.json")["Body"].read()
    )
    buckets = {manifest.spec.grid.context_bucket(len(p.prompt_token_ids)) for p in golden.prompts}
    assert buckets == {64, 128, 256}

    code, out, _ = run(capsys, "artifacts", "promote", uri, "--alias", "stable")
    alias, pinned = out[-2:]
    assert code == 0 and alias == f"s3://{bucket}/art/stories260K/aliases/stable"
    stored = s3.client().get_object(Bucket=bucket, Key=uri.split("/", 3)[3] + "/manifest.json")["Body"].read()
    assert pinned == f"{uri}@sha256:{hashlib.sha256(stored).hexdigest()}"
    code, out, err = run(capsys, "artifacts", "show", f"{alias}@sha256:{hashlib.sha256(stored).hexdigest()}")
    assert code == 0 and f"pinned: {pinned}" in err
    code, _, err = run(capsys, "artifacts", "verify", f"{uri}@sha256:{'0' * 64}")
    assert code != 0 and "is pinned to sha256:" in err
    code, out, _ = run(capsys, "artifacts", "list", f"s3://{bucket}/art")
    assert code == 0 and any(line.startswith(uri) and "validated" in line for line in out)
    assert any(line.startswith(alias) and manifest.artifact_id in line for line in out)
    code, out, _ = run(capsys, "artifacts", "show", alias)
    assert code == 0 and json.loads("\n".join(out))["config_hash"] == manifest.config_hash
    code, out, _ = run(capsys, "artifacts", "verify", alias)
    assert code == 0 and out[-1].startswith(f"verified {len(manifest.files)} files")

    artifact = load_artifact(alias, tmp_path / "cache")
    backend = TorchBackend.load(artifact.root, artifact.manifest.spec)
    try:
        assert replay(backend, Golden.load(artifact.path("golden.json"))).passed
    finally:
        backend.close()

    before = keys(s3, bucket)
    code, out, err = run(
        capsys, "compile", "--model", str(stories260k), "--output", f"s3://{bucket}/art", *SMALL_GRID
    )
    assert code == 0 and out[-1] == uri and "already published" in err
    assert keys(s3, bucket) == before


def test_an_s3_source_gets_the_same_content_address(s3, bucket, stories260k, capsys, tmp_path) -> None:
    upload_tree(s3.client(), stories260k, bucket, "checkpoints/stories260K")
    local = run(capsys, "compile", "--model", str(stories260k), "--output", str(tmp_path), *SMALL_GRID)
    remote = run(
        capsys,
        "compile",
        "--model",
        f"s3://{bucket}/checkpoints/stories260K",
        "--output",
        str(tmp_path),
        *SMALL_GRID,
    )
    assert local[0] == remote[0] == 0
    assert local[1][-1] == remote[1][-1] and "already published" in remote[2]


def test_a_random_model_compiles_and_says_its_weights_are_random(capsys, tmp_path) -> None:
    code, out, err = run(capsys, "compile", "--output", str(tmp_path), *TINY)
    assert code == 0, err
    manifest = Manifest.loads((Path(out[-1]) / MANIFEST_NAME).read_text())
    assert manifest.random_weights and "random" in manifest.notes["weights"]
    assert manifest.model_name == "random-tiny" and manifest.validation.passed
    assert "random" in err


@pytest.mark.parametrize(
    ("fields", "extra", "message"),
    [
        ({"model_type": "gpt2"}, [], "not a Llama checkpoint: model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, [], "unsupported config.json field hidden_act='gelu'"),
        ({"hidden_size": 32}, [], "has shape [512, 64], expected [512, 32]"),
        (
            {},
            ["--max-positions", "1024"],
            "max_positions 1024 exceeds the model's max_position_embeddings 512",
        ),
        (
            {},
            ["--max-positions", "256", "--context-buckets", "64,512"],
            "largest context bucket 512 exceeds max_positions 256",
        ),
        (
            {},
            ["--max-positions", "256", "--token-buckets", "64,128"],
            "largest token bucket 128 must equal max_positions 256",
        ),
        ({}, ["--tp", "3"], "not divisible by tp_degree 3"),
        ({}, ["--backend", "tpu"], "no compile builder for backend 'tpu'"),
        ({}, ["--name", "../escape"], "model name '../escape' must be"),
    ],
)
def test_bad_input_is_one_clear_error_before_any_work(
    edited_checkpoint, capsys, tmp_path, fields, extra, message
) -> None:
    output = tmp_path / "out"
    code, out, err = run(
        capsys, "compile", "--model", str(edited_checkpoint(**fields)), "--output", str(output), *extra
    )
    assert code == 1 and out == []
    assert message in err and err.count("\n") == 1, err
    assert not output.exists()


def test_a_missing_source_is_a_clear_error(s3, bucket, capsys, tmp_path) -> None:
    for source in (str(tmp_path / "nowhere"), f"s3://{bucket}/no/checkpoint", "random:huge"):
        code, _, err = run(capsys, "compile", "--model", source, "--output", str(tmp_path / "out"))
        assert code == 1 and ("no config.json" in err or "unknown random model preset 'huge'" in err), err


def test_a_failed_validation_publishes_nothing(s3, bucket, capsys, monkeypatch) -> None:
    real = pipeline.record_golden

    def wrong_reference(checkpoint: Path, grid) -> Golden:
        golden = real(checkpoint, grid)
        first = golden.prompts[0]
        tampered = GoldenPrompt(
            first.prompt,
            first.prompt_token_ids,
            (first.token_ids[0] + 1, *first.token_ids[1:]),
            first.top_logprobs,
        )
        return Golden((tampered, *golden.prompts[1:]))

    monkeypatch.setattr(pipeline, "record_golden", wrong_reference)
    code, out, err = run(capsys, "compile", "--output", f"s3://{bucket}/art", *TINY)
    assert code == 1 and out == []
    assert "validation failed, nothing published" in err and "greedy mismatch" in err
    assert keys(s3, bucket) == []


def test_an_interrupted_publish_leaves_no_manifest_and_a_rerun_completes(
    s3, bucket, capsys, monkeypatch, tmp_path
) -> None:
    from app.artifacts.storage import S3Store

    real_upload, uploads = S3Store.upload, []

    def crash_on_third(self, path, key):
        uploads.append(key)
        if len(uploads) == 3:
            raise KeyboardInterrupt
        real_upload(self, path, key)

    monkeypatch.setattr(S3Store, "upload", crash_on_third)
    code, _, err = run(capsys, "compile", "--output", f"s3://{bucket}/art", *TINY)
    assert code == 130 and "nothing was published" in err
    assert len(keys(s3, bucket)) == 2 and not any(key.endswith(MANIFEST_NAME) for key in keys(s3, bucket))
    monkeypatch.setattr(S3Store, "upload", real_upload)
    code, out, err = run(capsys, "compile", "--output", f"s3://{bucket}/art", *TINY)
    assert code == 0 and "published" in err
    assert load_artifact(out[-1], tmp_path / "cache").manifest.validation.passed


def test_publish_never_overwrites_a_different_artifact(tmp_path) -> None:
    from app.artifacts.storage import LocalStore
    from loadtest.harness.synthetic import write_artifact

    staging, dest = tmp_path / "staging", LocalStore(tmp_path / "dest")
    manifest = write_artifact(staging, {"a.bin": b"one"})
    assert publish(staging, manifest, dest) is True
    assert publish(staging, manifest, dest) is False
    other = write_artifact(tmp_path / "other", {"a.bin": b"two"}, config_hash=manifest.config_hash)
    with pytest.raises(ArtifactError, match="already holds a different published artifact"):
        publish(tmp_path / "other", other, dest)
    assert (dest.root / "a.bin").read_bytes() == b"one"


def test_an_s3_checkpoint_is_hashed_once_on_the_way_in(
    s3, bucket, stories260k, tmp_path, monkeypatch
) -> None:
    upload_tree(s3.client(), stories260k, bucket, "checkpoints/stories260K")
    local_sha256 = pipeline.checkpoint_sha256(stories260k)
    checkpoint, hashed = pipeline.fetch_checkpoint(f"s3://{bucket}/checkpoints/stories260K", tmp_path)
    assert {path.name for path in pipeline.checkpoint_files(checkpoint)} <= set(hashed)

    def read_again(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a downloaded checkpoint file was hashed again: {args}")

    monkeypatch.setattr(pipeline, "hash_object", read_again)
    assert pipeline.checkpoint_sha256(checkpoint, hashed) == local_sha256
