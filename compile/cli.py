"""`inf2serve compile` and `inf2serve artifacts list|show|verify|promote`.

Results go to stdout (for `compile`, the last line is the published URI); progress and errors go to
stderr; any failure is one message and a non-zero exit.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.artifacts.loader import ALIASES_DIR, load_artifact, open_artifact, pinned_reference, verify_files
from app.artifacts.manifest import MANIFEST_NAME, Manifest
from app.artifacts.storage import open_store
from app.backends.memory import GIB, MemoryPlan
from app.backends.quantization import (
    DEFAULT_MODULES_TO_NOT_CONVERT,
    GRANULARITIES,
    KV_CACHE_DTYPES,
    QUANT_DTYPES,
    QuantScheme,
)
from app.errors import ConfigError, Inf2ServeError
from compile.prefix_caching import DEFAULT_KV_BLOCK_SIZE, PrefixCachingOptions
from compile.publish import promote

Handler = Callable[[argparse.Namespace], int]


def reports_errors(command: str) -> Callable[[Callable[[argparse.Namespace], None]], Handler]:
    """Run a command; an inf2serve error becomes one line on stderr and exit status 1."""

    def decorate(run: Callable[[argparse.Namespace], None]) -> Handler:
        @functools.wraps(run)
        def handler(args: argparse.Namespace) -> int:
            try:
                run(args)
            except Inf2ServeError as error:
                print(f"inf2serve {command}: error: {error.message}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:
                print(f"inf2serve {command}: interrupted; nothing was published", file=sys.stderr)
                return 130
            return 0

        return handler

    return decorate


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error


def register_compile(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compile",
        help="compile a checkpoint into a validated artifact and publish it",
        description="Compile a Hugging Face Llama checkpoint into a validated, content-addressed artifact.",
    )
    parser.add_argument("--model", required=True, help="checkpoint dir, s3:// prefix or random:<preset>")
    parser.add_argument("--output", required=True, help="artifact root: a directory or s3://bucket/prefix")
    parser.add_argument("--backend", default="torch", help="backend to compile for (default: torch)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1)")
    parser.add_argument("--batch-size", type=int, default=8, help="compiled batch: number of slots")
    parser.add_argument("--max-positions", type=int, help="sequence capacity (default: from the config)")
    parser.add_argument("--context-buckets", type=int_list, help="prefill lengths, e.g. 128,256,512")
    parser.add_argument("--token-buckets", type=int_list, help="decode KV lengths, ending at max positions")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument(
        "--decode-batches", type=int_list, help="decode batch sizes, e.g. 1,2,4 (neuron-nxdi: several graphs)"
    )
    parser.add_argument(
        "--async-mode", action="store_true", help="neuron-nxdi: run each decode step ahead (one decode batch)"
    )
    parser.add_argument("--name", help="model name in the artifact key (default: the source's name)")
    parser.add_argument(
        "--quantize", choices=QUANT_DTYPES, help="store the linear layers' weights in 8 bits (weight-only)"
    )
    parser.add_argument(
        "--quantization-type",
        choices=GRANULARITIES,
        default="per_channel",
        help="one scale per output channel (default) or per tensor",
    )
    parser.add_argument(
        "--modules-to-not-convert",
        type=name_list,
        default=DEFAULT_MODULES_TO_NOT_CONVERT,
        help="linear modules kept in full precision, comma-separated (default: lm_head; '' for none)",
    )
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="neuron-nxdi: quantize the KV cache"
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="neuron-nxdi: compile NxD Inference's prefix caching (KV in blocks, prefill x prefix buckets)",
    )
    parser.add_argument(
        "--kv-block-size",
        type=int,
        help=f"with --enable-prefix-caching: positions per KV block (default {DEFAULT_KV_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--kv-blocks", type=int, help="with --enable-prefix-caching: KV blocks (default: the minimum)"
    )
    parser.add_argument(
        "--prefix-buckets",
        type=int_list,
        help="with --enable-prefix-caching: cached-prefix lengths compiled (default: the token buckets)",
    )
    parser.add_argument(
        "--chat-template", type=Path, help="a Jinja chat template served instead of the checkpoint's"
    )
    parser.add_argument(
        "--allow-failed-validation",
        action="store_true",
        help="publish even if the validation gate fails, recording it (the server then needs the same flag)",
    )
    parser.set_defaults(handler=run_compile)


def name_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def quantization_scheme(args: argparse.Namespace) -> QuantScheme | None:
    if args.quantize is None:
        return None
    return QuantScheme(args.quantize, args.quantization_type, args.modules_to_not_convert)


def prefix_caching_options(args: argparse.Namespace) -> PrefixCachingOptions | None:
    if not args.enable_prefix_caching:
        named = [flag for flag in ("kv_block_size", "kv_blocks", "prefix_buckets") if getattr(args, flag)]
        if named:
            flags = ", ".join("--" + name.replace("_", "-") for name in named)
            raise ConfigError(f"{flags} apply only with --enable-prefix-caching")
        return None
    return PrefixCachingOptions(
        args.kv_block_size or DEFAULT_KV_BLOCK_SIZE, args.kv_blocks, args.prefix_buckets
    )


@reports_errors("compile")
def run_compile(args: argparse.Namespace) -> None:
    from transformers.utils import logging

    from compile.pipeline import CompileOptions, compile_artifact

    logging.disable_progress_bar()  # our own progress goes to stderr; keep transformers' quiet
    logging.set_verbosity_error()
    options = CompileOptions(
        model=args.model,
        output=args.output,
        backend=args.backend,
        tp_degree=args.tp,
        batch_size=args.batch_size,
        max_positions=args.max_positions,
        context_buckets=args.context_buckets,
        token_buckets=args.token_buckets,
        dtype=args.dtype,
        name=args.name,
        decode_batches=args.decode_batches,
        async_mode=args.async_mode,
        quantization=quantization_scheme(args),
        kv_cache_dtype=args.kv_cache_dtype,
        prefix_caching=prefix_caching_options(args),
        allow_failed_validation=args.allow_failed_validation,
        chat_template=args.chat_template,
    )
    print(compile_artifact(options).uri, flush=True)


REFERENCE_HELP = "artifact URI or alias URI, optionally pinned: ...@sha256:<manifest digest>"


def register_artifacts(subparsers: Any) -> None:
    parser = subparsers.add_parser("artifacts", help="list, show, verify and promote published artifacts")
    commands = parser.add_subparsers(dest="artifacts_command", required=True, metavar="ACTION")
    listing = commands.add_parser("list", help="list the artifacts and aliases under a root")
    listing.add_argument("root", help="artifact root: a directory or s3://bucket/prefix")
    listing.set_defaults(handler=run_list)
    for name, run, text in (
        ("show", run_show, "print an artifact's manifest"),
        ("verify", run_verify, "re-read every file and check it against the manifest"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("uri", help=REFERENCE_HELP)
        command.set_defaults(handler=run)
    pulling = commands.add_parser("pull", help="download and verify into the local cache; print its path")
    pulling.add_argument("uri", help=REFERENCE_HELP)
    pulling.add_argument("--cache-dir", type=Path, help="cache directory (default: the loader's)")
    pulling.set_defaults(handler=run_pull)
    promoting = commands.add_parser("promote", help="point an alias at an artifact")
    promoting.add_argument("uri", help=REFERENCE_HELP)
    promoting.add_argument("--alias", required=True, help="alias name, e.g. stable")
    promoting.set_defaults(handler=run_promote)


@reports_errors("artifacts list")
def run_list(args: argparse.Namespace) -> None:
    root = open_store(args.root)
    for key in root.list_keys():
        parts = key.split("/")
        if len(parts) >= 2 and parts[-1] == MANIFEST_NAME:
            artifact = root.child(*parts[:-1])
            print(describe(artifact.uri, Manifest.loads(root.read(key))))
        elif len(parts) >= 3 and parts[-2] == ALIASES_DIR:
            target = json.loads(root.read(key)).get("artifact_id", "?")
            print(f"{root.uri_of(key)}  alias -> {target}")


def describe(uri: str, manifest: Manifest) -> str:
    spec, grid = manifest.spec, manifest.spec.grid
    verdict = "validated" if manifest.validation.passed else "NOT validated"
    random = "  RANDOM WEIGHTS" if manifest.random_weights else ""
    quantized = f" {spec.quantization.label}" if spec.quantization is not None else ""
    return (
        f"{uri}  {manifest.artifact_id}  {spec.backend} tp{spec.tp_degree} {spec.dtype}{quantized} "
        f"slots={grid.num_slots} positions={grid.max_positions}{memory_figure(manifest.memory)}  "
        f"{manifest.created_at}  {verdict}{random}"
    )


def memory_figure(plan: MemoryPlan | None) -> str:
    """` memory=11.53GiB/16.00GiB` a rank (` memory=0.01GiB` without a device limit; `` unplanned)."""
    if plan is None:
        return ""
    capacity = f"/{plan.capacity_bytes / GIB:.2f}GiB" if plan.capacity_bytes is not None else ""
    return f" memory={plan.total_bytes / GIB:.2f}GiB{capacity}"


@reports_errors("artifacts show")
def run_show(args: argparse.Namespace) -> None:
    store, manifest = open_artifact(args.uri)
    print(f"pinned: {pinned_reference(store)}", file=sys.stderr)
    print(manifest.dumps(), end="")


@reports_errors("artifacts verify")
def run_verify(args: argparse.Namespace) -> None:
    store, manifest = open_artifact(args.uri)
    verify_files(store, manifest, every_digest=True)
    print(f"verified {len(manifest.files)} files, {manifest.total_bytes} bytes: {store.uri}")


@reports_errors("artifacts pull")
def run_pull(args: argparse.Namespace) -> None:
    artifact = load_artifact(args.uri, args.cache_dir)
    print(artifact.root)


@reports_errors("artifacts promote")
def run_promote(args: argparse.Namespace) -> None:
    """Prints the alias URI, then the pinned reference to deploy (what the alias names now)."""
    store, manifest = open_artifact(args.uri)
    print(promote(store, manifest, args.alias))
    print(pinned_reference(store))
