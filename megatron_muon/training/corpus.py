"""From text to a Megatron indexed dataset (.bin/.idx) that `--data-path` trains on, and the check that a dataset's
token ids fit the recipe's vocabulary.

Tokenizers: "byte" (the default, nothing to download): each UTF-8 byte is a token and id 255, a byte UTF-8 never
uses, ends every document, so vocab_size 256 fits and megatron's default end-of-document id (vocab_size - 1) is
the right one; or a Hugging Face `tokenizer.json` (the `tokenizers` library), whose end-of-document token is the
one named, else the first special token like `</s>` or `<|endoftext|>` it knows. A `<prefix>.meta.json` next to the
dataset records the tokenizer, its vocabulary size and end-of-document id for the training-side check.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy

from megatron_muon.training.config import RecipeError

BYTE_EOD = 255
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class DataError(RecipeError):
    """A dataset or tokenizer the user can fix; the message names how."""


@dataclass(frozen=True)
class CorpusMeta:
    tokenizer: str
    vocab_size: int  # every id in the dataset is below this
    eod_id: int
    documents: int
    tokens: int


class ByteTokenizer:
    name, vocab_size, eod_id = "byte", 256, BYTE_EOD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HuggingFaceTokenizer:
    """A `tokenizer.json` through the `tokenizers` library; end of document: `eod_token`, or a known special token."""

    def __init__(self, path: str, eod_token: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError as error:  # pragma: no cover - a declared dependency
            raise DataError("a tokenizer.json needs the `tokenizers` package: pip install tokenizers") from error
        if not Path(path).is_file():
            raise DataError(f"no tokenizer file at {path}; pass a Hugging Face tokenizer.json, or --tokenizer byte")
        self.name = str(path)
        self._tokenizer = Tokenizer.from_file(str(path))
        names = [eod_token] if eod_token else list(EOD_CANDIDATES)
        ids = [self._tokenizer.token_to_id(name) for name in names]
        found = [i for i in ids if i is not None]
        if not found:
            raise DataError(f"{path} knows none of {', '.join(names)} as a token; name its end-of-document token "
                            "with --eod-token")
        self.eod_id = found[0]
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def tokenizer_named(spec: str, eod_token: str | None = None):
    return ByteTokenizer() if spec == "byte" else HuggingFaceTokenizer(spec, eod_token)


def read_documents(paths: Iterable[str], json_key: str = "text") -> Iterator[str]:
    """JSONL files: one document per line (its `json_key` field); any other file: the whole file is one document."""
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"no input file at {path}")
        if path.suffix in (".jsonl", ".json"):
            with path.open(encoding="utf-8") as lines:
                for number, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as error:
                        raise DataError(f"{path}:{number} is not JSON ({error.msg}); give one JSON object per line, "
                                        f"or a plain-text file") from error
                    if not isinstance(record, dict) or json_key not in record:
                        raise DataError(f"{path}:{number} has no '{json_key}' field; name the text field with "
                                        "--json-key")
                    yield str(record[json_key])
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def write_indexed_dataset(documents: Iterable[str], output_prefix: str, tokenizer, progress=None) -> CorpusMeta:
    """Tokenize and write `<output_prefix>.bin/.idx` (megatron's IndexedDatasetBuilder) and `.meta.json`."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = numpy.uint16 if max(tokenizer.vocab_size, tokenizer.eod_id + 1) <= 65535 else numpy.int32
    builder = IndexedDatasetBuilder(f"{output_prefix}.bin", dtype=dtype)
    count = tokens = 0
    for text in documents:
        ids = tokenizer.encode(text) + [tokenizer.eod_id]
        if len(ids) < 2:
            continue
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
        count, tokens = count + 1, tokens + len(ids)
        if progress is not None:
            progress.update(1)
    if count == 0:
        raise DataError("the input holds no text to tokenize; give non-empty files")
    builder.finalize(f"{output_prefix}.idx")
    meta = CorpusMeta(tokenizer.name, max(tokenizer.vocab_size, tokenizer.eod_id + 1), tokenizer.eod_id, count, tokens)
    Path(f"{output_prefix}.meta.json").write_text(json.dumps(asdict(meta), indent=1) + "\n")
    return meta


def _prefixes(blend: list[str]) -> list[str]:
    """The dataset prefixes of a megatron blend ["p"] or ["w1", "p1", "w2", "p2"]."""
    if len(blend) > 1 and len(blend) % 2 == 0:
        try:
            float(blend[0])
            return blend[1::2]
        except ValueError:
            pass
    return list(blend)


def check_token_ids(blend: list[str], vocab_size: int, eod_id: int, scan_limit: int = 1 << 28) -> None:
    """Every dataset of the blend exists and its ids fit `vocab_size` (from its `.meta.json`, else by reading up to
    `scan_limit` tokens of it), and its end-of-document id is the run's: before megatron indexes an embedding row
    that does not exist (an IndexError on CPU, a device assert on a GPU)."""
    for prefix in _prefixes(blend):
        if not (Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()):
            raise DataError(f"no dataset at {prefix} ({prefix}.bin and {prefix}.idx); write one with "
                            "`megatron-muon prepare-data --input FILE --output-prefix PREFIX`")
        meta_path = Path(f"{prefix}.meta.json")
        if meta_path.is_file():
            meta = json.loads(meta_path.read_text())
            needed, dataset_eod = int(meta["vocab_size"]), int(meta["eod_id"])
            if dataset_eod != eod_id:
                raise DataError(f"{prefix} ends documents with id {dataset_eod} (its {meta['tokenizer']} tokenizer) "
                                f"but the run uses {eod_id}; add --set data.eod_id={dataset_eod}")
        else:
            from megatron.core.datasets.indexed_dataset import IndexedDataset

            dtype = IndexedDataset(prefix).index.dtype
            tokens = numpy.memmap(f"{prefix}.bin", dtype=dtype, mode="r")
            needed = int(tokens[:scan_limit].max()) + 1 if len(tokens) else 0
        if needed > vocab_size:
            raise DataError(f"{prefix} holds token ids up to {needed - 1} but model.vocab_size is {vocab_size}; set "
                            f"--set model.vocab_size={needed} (or more), or prepare the data with a smaller tokenizer")
