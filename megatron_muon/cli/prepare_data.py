"""`megatron-muon prepare-data`: text or JSONL in, a Megatron indexed dataset out (what `--data-path` trains on)."""

from __future__ import annotations

import argparse


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "prepare-data", help="tokenize text/JSONL into a Megatron indexed dataset for --data-path",
        description="Tokenize text into PREFIX.bin/.idx (megatron's indexed dataset) and PREFIX.meta.json. JSONL "
                    "files give one document per line (--json-key field); other files are one document each.")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE", help="text or JSONL files")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json; train with --data-path PREFIX")
    parser.add_argument("--tokenizer", default="byte",
                        help="'byte' (UTF-8 bytes, vocab 256, nothing to download) or a Hugging Face tokenizer.json")
    parser.add_argument("--eod-token", default=None,
                        help="the tokenizer.json's end-of-document token (default: the first of </s>, "
                             "<|endoftext|>, ... it knows)")
    parser.add_argument("--json-key", default="text", help="the text field of each JSONL record")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from megatron_muon.training.corpus import read_documents, tokenizer_named, write_indexed_dataset

    tokenizer = tokenizer_named(args.tokenizer, args.eod_token)
    with tqdm(desc="documents", unit=" docs", leave=False, disable=None) as progress:  # a bar on terminals only
        meta = write_indexed_dataset(read_documents(args.input, args.json_key), args.output_prefix, tokenizer,
                                     progress)
    print(f"wrote {args.output_prefix}.bin/.idx: {meta.documents:,} documents, {meta.tokens:,} tokens "
          f"(tokenizer {meta.tokenizer}, vocab {meta.vocab_size}, end-of-document id {meta.eod_id}); train with "
          f"--data-path {args.output_prefix} --set model.vocab_size={meta.vocab_size} "
          f"--set data.eod_id={meta.eod_id}")
    return 0
