"""``balanced-loader build-shards FILES_OR_GLOBS --out DIR``: tokenize files into webdataset shards."""

from __future__ import annotations

import argparse
import sys

from balanced_loader.cli.options import COUNT, MEGABYTES, int_in


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="FILES_OR_GLOBS",
                   help="files, folders (every non-hidden file under them) or quoted globs ('src/**/*.py'); "
                        "a .jsonl file gives one doc per line, any other file one doc")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="shard folder to create (absent or empty); written beside it and renamed into place when "
                        "complete, so a failed build leaves nothing; locked while it is built")
    p.add_argument("--tokenizer", default="bytes",
                   help="'bytes' (default, token = byte) or a local tokenizer.json / folder "
                        "(needs the tokenizers or transformers package)")
    p.add_argument("--text-field", default="text", help="the text key of .jsonl lines (default: text)")
    p.add_argument("--shard-mb", type=MEGABYTES, default=256.0, help="largest shard size in MB (default 256)")
    p.add_argument("--docs-per-shard", type=COUNT, default=100_000, help="most docs per shard (default 100000)")
    p.add_argument("--workers", type=int_in(1, 1024), default=1, metavar="N",
                   help="processes that read, parse and tokenize the input (default 1); the same output for any N")
    p.add_argument("--part", type=_part, metavar="K/N",
                   help="build only part K of N (0-based) for one machine of N: the docs that start in bytes "
                        "[K*B/N, (K+1)*B/N) of the inputs taken in order as one stream; the N part folders "
                        "opened together hold exactly the docs of one whole build, in its order "
                        "(e.g. --part $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)")
    p.add_argument("--decode-errors", choices=("error", "replace"), default="error",
                   help="text that is not valid UTF-8 (.jsonl lines; whole files for a Hugging Face tokenizer): "
                        "'error' (default) refuses it naming the file, 'replace' decodes invalid bytes as U+FFFD "
                        "and counts the docs in the summary and shards.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the summary and speed lines stay)")


def _part(text: str) -> tuple[int, int]:
    from balanced_loader.build.builder import parse_part

    try:
        return parse_part(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--part must be ")) from None


def run(args: argparse.Namespace) -> int:
    from balanced_loader.build.builder import build_from_files, expand_inputs

    files = expand_inputs(args.inputs)
    meta = build_from_files(files, args.out, tokenizer=args.tokenizer, text_field=args.text_field,
                            max_shard_bytes=int(args.shard_mb * 2**20), max_docs_per_shard=args.docs_per_shard,
                            progress=not args.no_progress and sys.stderr.isatty(),
                            workers=args.workers, part=args.part, decode_errors=args.decode_errors)
    total = sum(s["bytes"] for s in meta["shards"])
    part = f"part {args.part[0]}/{args.part[1]}: " if args.part else ""
    print(f"{part}{meta['num_docs']} docs, {meta['num_tokens']} tokens ({meta['dtype']}) from {len(files)} files "
          f"-> {len(meta['shards'])} shards, {total / 2**20:.1f} MB in {args.out} "
          f"(tokenizer {meta['tokenizer']['name']}; " + ("length index built)" if meta["num_docs"] else "no docs)"))
    b = meta["build"]
    if b["decode_errors"]:
        print(f"note: {b['decode_errors']} doc(s) were not valid UTF-8; their invalid bytes were replaced with U+FFFD "
              f"(--decode-errors replace)")
    print(f"speed: {b['docs_per_s']:,.0f} docs/s, {b['mb_per_s']:.2f} MB/s of input ({b['docs']} docs, "
          f"{b['input_bytes'] / 2**20:.1f} MB in {b['seconds']:.2f} s, {b['workers']} worker(s))")
    return 0
