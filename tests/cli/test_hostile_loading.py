"""Hostile model folders against the one loader check (`switchhead.integrity.check_saved_model`): what is checked is
exactly what Transformers loads, and weights that Transformers would load silently wrong (dropped, cast, taken from
another file) are refused in one line.

Most cases call the check directly on a tiny saved folder (cheap); the command-level cases run `main(argv)` in
process and assert the error contract (exit 2, one stderr line) for generate, eval, export and serve.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.hub_folder import save_hub_folder
from helpers.server import free_port

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.cli import main
from switchhead.integrity import UnloadableModel, check_saved_model
from switchhead.integrity.loading import weight_files

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny two-layer model folder (config.json, model.safetensors, the copied model code)."""
    folder = tmp_path_factory.mktemp("saved") / "model"
    torch.manual_seed(0)
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead")).save_pretrained(folder)
    return folder


@pytest.fixture
def folder(saved, tmp_path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(saved, copy)
    return copy


def refused(folder: Path, *words: str) -> str:
    with pytest.raises(UnloadableModel) as caught:
        check_saved_model(str(folder), verify=False)
    message = str(caught.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    return message


def tensors_of(folder: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(folder / name)


def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, path, metadata={"format": "pt"})


def shard(folder: Path, parts: dict[str, dict[str, torch.Tensor]], weight_map: dict[str, str] | None = None) -> None:
    """Replace model.safetensors by shards {file: tensors} and an index (by default listing each tensor's shard)."""
    (folder / "model.safetensors").unlink(missing_ok=True)
    for name, tensors in parts.items():
        save(tensors, folder / name)
    if weight_map is None:
        weight_map = {key: name for name, tensors in parts.items() for key in tensors}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def halves(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    keys = sorted(tensors)
    return {"model-00001-of-00002.safetensors": {k: tensors[k] for k in keys[: len(keys) // 2]},
            "model-00002-of-00002.safetensors": {k: tensors[k] for k in keys[len(keys) // 2:]}}


def edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


# --------------------------------------------------------------------------- which file Transformers loads
def test_a_clean_folder_and_a_clean_sharded_folder_pass(folder):
    assert check_saved_model(str(folder), verify=False) is False  # the trust decision: no code from the folder
    shard(folder, halves(tensors_of(folder)))
    assert weight_files(str(folder)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    check_saved_model(str(folder), verify=False)


def test_transformers_loads_model_safetensors_over_an_index_which_is_why_both_are_refused(folder):
    """The premise of the refusal below: with both present, Transformers reads model.safetensors, not the shards."""
    clean = tensors_of(folder)
    changed = {key: value.clone() for key, value in clean.items()}
    changed[Q_PROJ].fill_(0.5)
    shard(folder, halves(clean))
    save(changed, folder / "model.safetensors")
    model = SwitchHeadForCausalLM.from_pretrained(folder, trust_remote_code=False)
    assert torch.equal(model.state_dict()[Q_PROJ], changed[Q_PROJ])


def test_nan_model_safetensors_beside_an_index_of_clean_shards_is_refused(folder):
    clean = tensors_of(folder)
    nan = {key: value.clone() for key, value in clean.items()}
    nan[Q_PROJ][0, 0] = float("nan")
    shard(folder, halves(clean))
    save(nan, folder / "model.safetensors")
    refused(folder, "holds both model.safetensors and model.safetensors.index.json")


def test_a_clean_model_safetensors_beside_an_index_is_refused_too(folder):
    shard(folder, halves(tensors_of(folder)))
    whole = {}
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        whole.update(load_file(folder / name))
    save(whole, folder / "model.safetensors")
    refused(folder, "holds both")


def test_transformers_weights_in_config_is_the_file_checked_as_it_is_the_file_loaded(folder):
    """config.json's `transformers_weights` makes Transformers load another file: that file is the one checked."""
    clean = tensors_of(folder)
    other = {key: value.clone() for key, value in clean.items()}
    other[Q_PROJ].fill_(0.25)
    save(other, folder / "other.safetensors")
    nan = {key: value.clone() for key, value in clean.items()}
    nan[Q_PROJ][0, 0] = float("nan")
    save(nan, folder / "model.safetensors")
    edit_config(folder, transformers_weights="other.safetensors")
    assert weight_files(str(folder)) == ["other.safetensors"]
    check_saved_model(str(folder), verify=False)  # model.safetensors (NaN) is not what is loaded
    model = SwitchHeadForCausalLM.from_pretrained(folder, trust_remote_code=False)
    assert torch.equal(model.state_dict()[Q_PROJ], other[Q_PROJ])
    save(nan, folder / "other.safetensors")
    refused(folder, "other.safetensors", "NaN or infinite")


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd.safetensors", "sub/inner.safetensors",
                                  "weights.bin", 7])
def test_transformers_weights_outside_the_folder_or_not_safetensors_is_refused(folder, name):
    edit_config(folder, transformers_weights=name)
    refused(folder, "transformers_weights")


def test_a_lora_adapter_beside_the_model_is_refused(folder):
    """Transformers would load the model and apply the adapter's tensors on top: not the weights checked."""
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "gpt2", "peft_type": "LORA"}))
    refused(folder, "LoRA adapter (adapter_config.json)")


# --------------------------------------------------------------------------- weight files that are not files
def test_a_symlinked_weight_file_is_read_through_as_in_a_hub_cache(folder, tmp_path):
    blob = tmp_path / "blob"
    shutil.move(folder / "model.safetensors", blob)
    (folder / "model.safetensors").symlink_to(blob)
    check_saved_model(str(folder), verify=False)
    tensors = load_file(blob)
    tensors[Q_PROJ][1, 1] = float("inf")
    save(tensors, blob)
    refused(folder, "NaN or infinite")  # what the link points to is what is checked


def test_a_weight_file_linked_to_a_fifo_is_refused_without_hanging(folder, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(fifo)
    refused(folder, "holds model.safetensors, which is not a regular file")
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    refused(folder, "holds model.safetensors, which is not a regular file")


def test_a_dangling_link_or_a_folder_as_weight_file_is_refused(folder, tmp_path):
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(tmp_path / "nowhere")
    refused(folder, "model.safetensors is a link to nothing")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    refused(folder, "model.safetensors is a folder")


def test_a_shard_that_is_a_fifo_is_refused(folder):
    shard(folder, halves(tensors_of(folder)))
    second = folder / "model-00002-of-00002.safetensors"
    second.unlink()
    os.mkfifo(second)
    refused(folder, "holds model-00002-of-00002.safetensors, which is not a regular file")


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "generation_config.json", "tokenizer.json",
                                  "anything"])
def test_a_fifo_or_device_anywhere_in_the_folder_is_refused_without_hanging(folder, tmp_path, name):
    """Transformers opens the config files it finds without asking; a FIFO would block it forever."""
    path = folder / name
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    refused(folder, f"holds {name}, which is not a regular file")
    path.unlink()
    path.symlink_to("/dev/zero")
    refused(folder, f"holds {name}, which is not a regular file")


# --------------------------------------------------------------------------- indexes that lie
@pytest.mark.parametrize("name", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../x.safetensors",
                                  "..", ""])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(folder, name, tmp_path):
    clean = tensors_of(folder)
    save(clean, tmp_path / "outside.safetensors")
    shard(folder, {}, {key: name for key in clean})
    refused(folder, "is not a file name inside the folder")


def test_an_index_listing_a_missing_shard_is_refused(folder):
    parts = halves(tensors_of(folder))
    shard(folder, parts)
    (folder / "model-00002-of-00002.safetensors").unlink()
    refused(folder, "model-00002-of-00002.safetensors is missing")


def test_a_tensor_in_two_shards_is_refused(folder):
    parts = halves(tensors_of(folder))
    first, second = parts
    duplicate = next(iter(parts[first]))
    parts[second][duplicate] = parts[first][duplicate] + 1
    weight_map = {key: name for name, tensors in parts.items() for key in tensors if key != duplicate}
    weight_map[duplicate] = first
    shard(folder, parts, weight_map)
    refused(folder, duplicate, "is stored in both")


def test_an_index_putting_a_tensor_in_the_wrong_shard_is_refused(folder):
    parts = halves(tensors_of(folder))
    first, second = parts
    weight_map = {key: name for name, tensors in parts.items() for key in tensors}
    moved = next(iter(parts[first]))
    weight_map[moved] = second
    shard(folder, parts, weight_map)
    refused(folder, f"puts {moved} in {second}, which does not hold it")


def test_a_shard_holding_a_tensor_the_index_does_not_list_is_refused(folder):
    parts = halves(tensors_of(folder))
    weight_map = {key: name for name, tensors in parts.items() for key in tensors}
    dropped = sorted(weight_map)[-1]
    del weight_map[dropped]
    shard(folder, parts, weight_map)
    refused(folder, f"holds {dropped}, which model.safetensors.index.json does not list")


@pytest.mark.parametrize("index", ['{"weight_map": []}', '{"weight_map": {}}', '{"metadata": {}}', "[1, 2]",
                                   "not json", '{"weight_map": {"a": 3}}', "[" * 100000])
def test_an_unreadable_index_is_refused(folder, index):
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(index)
    refused(folder, "model.safetensors.index.json")


def test_an_index_naming_a_pickle_shard_is_refused(folder):
    clean = tensors_of(folder)
    shard(folder, {}, {key: "pytorch_model-00001.bin" for key in clean})
    torch.save(clean, folder / "pytorch_model-00001.bin")
    refused(folder, "is not a .safetensors file")


# --------------------------------------------------------------------------- safetensors files that lie
def _raw_file(header: dict | bytes, data: bytes, length: int | None = None) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(body) if length is None else length) + body + data


@pytest.mark.parametrize("content", [
    _raw_file(b"{}", b"", length=2**40),  # a header length past the end of the file
    _raw_file({Q_PROJ: {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 16384]}}, b"\0" * 100),  # truncated
    _raw_file({Q_PROJ: {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 8]}}, b"\0" * 8),  # shape != bytes
    _raw_file(b"this is not json", b""),
    _raw_file({Q_PROJ: {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),  # unknown dtype
    b"\x01\x02",  # shorter than the length field
], ids=["header-length", "truncated-data", "shape-vs-offsets", "header-not-json", "unknown-dtype", "two-bytes"])
def test_a_safetensors_header_that_lies_is_refused_in_one_line(folder, content):
    (folder / "model.safetensors").write_bytes(content)
    refused(folder, "model.safetensors is not a readable .safetensors file")


# --------------------------------------------------------------------------- tensors that do not fit config.json
def test_a_two_layer_checkpoint_under_a_one_layer_config_is_refused(folder):
    """Transformers would build one layer and drop the second layer's tensors as unexpected."""
    edit_config(folder, num_hidden_layers=1)
    refused(folder, "num_hidden_layers 1, but the weights hold 2 layers")


def test_a_tensor_the_model_does_not_have_is_refused(folder):
    tensors = tensors_of(folder)
    tensors["model.layers.0.self_attn.backdoor.weight"] = torch.zeros(3)
    save(tensors, folder / "model.safetensors")
    refused(folder, "model.layers.0.self_attn.backdoor.weight is not a tensor of config.json's model")


def test_a_huge_num_hidden_layers_is_refused_before_anything_is_built(folder):
    edit_config(folder, num_hidden_layers=10**12)
    refused(folder, "num_hidden_layers 1000000000000, but the weights hold 2 layers")


@pytest.mark.parametrize("value", [-3, 0, True, 2.5, "2"])
def test_a_num_hidden_layers_that_is_not_a_positive_whole_number_is_refused(folder, value):
    edit_config(folder, num_hidden_layers=value)
    refused(folder, "num_hidden_layers")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool])
def test_integer_or_bool_tensors_for_float_parameters_are_refused_not_cast(folder, dtype):
    tensors = tensors_of(folder)
    tensors[Q_PROJ] = torch.ones_like(tensors[Q_PROJ], dtype=dtype)
    save(tensors, folder / "model.safetensors")
    refused(folder, Q_PROJ, "is stored as", "Transformers would cast it")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_pass_and_their_nan_or_inf_is_refused(folder, dtype):
    tensors = {key: value.to(dtype) for key, value in tensors_of(folder).items()}
    save(tensors, folder / "model.safetensors")
    check_saved_model(str(folder), verify=False)
    tensors[Q_PROJ][0, 0] = float("inf") if dtype != torch.bfloat16 else float("nan")
    save(tensors, folder / "model.safetensors")
    refused(folder, Q_PROJ, "NaN or infinite")


def test_float8_weights_are_checked_for_nan_too(folder):
    tensors = {key: value.to(torch.float8_e4m3fn) for key, value in tensors_of(folder).items()}
    save(tensors, folder / "model.safetensors")
    check_saved_model(str(folder), verify=False)
    tensors[Q_PROJ] = tensors[Q_PROJ].float()
    tensors[Q_PROJ][0, 0] = float("nan")
    tensors[Q_PROJ] = tensors[Q_PROJ].to(torch.float8_e4m3fn)
    save(tensors, folder / "model.safetensors")
    refused(folder, Q_PROJ, "NaN or infinite")


@pytest.mark.parametrize("dtype", [torch.complex64])
def test_complex_tensors_for_float_parameters_are_refused(folder, dtype):
    tensors = tensors_of(folder)
    tensors[Q_PROJ] = tensors[Q_PROJ].to(dtype)
    save(tensors, folder / "model.safetensors")
    refused(folder, Q_PROJ, "is stored as")


def test_fp16_overflow_to_inf_is_refused(folder):
    tensors = tensors_of(folder)
    tensors[Q_PROJ][2, 3] = 1e6  # finite in float32, inf in float16
    save({key: value.half() for key, value in tensors.items()}, folder / "model.safetensors")
    refused(folder, "NaN or infinite")


@pytest.mark.parametrize("text", ["[1, 2]", "[" * 100000, '"a string"', "", "{\"model_type\": 7}"],
                         ids=["list", "deep", "string", "empty", "type-not-a-string"])
def test_a_config_json_that_is_not_a_config_object_is_refused_in_one_line(folder, text):
    (folder / "config.json").write_text(text)
    refused(folder, "config.json")


def test_transformers_weights_naming_an_index_checks_its_shards(folder):
    parts = halves(tensors_of(folder))
    shard(folder, parts)
    (folder / "model.safetensors.index.json").rename(folder / "custom.safetensors.index.json")
    edit_config(folder, transformers_weights="custom.safetensors.index.json")
    assert weight_files(str(folder)) == sorted(parts)
    check_saved_model(str(folder), verify=False)
    broken = load_file(folder / sorted(parts)[1])
    broken[next(iter(broken))].view(-1)[0] = float("nan")
    save(broken, folder / sorted(parts)[1])
    refused(folder, sorted(parts)[1], "NaN or infinite")


# --------------------------------------------------------------------------- the commands use this check
@pytest.fixture(scope="module")
def hub_saved(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hub") / "model"
    save_hub_folder(folder, "tiny-switchhead")
    return folder


def one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"switchhead {command}: error: "), err
    return lines[0]


@pytest.mark.parametrize("damage", ["nan-beside-index", "two-layers-under-one", "int-tensor", "bool-tensor",
                                    "index-escapes"])
def test_generate_eval_export_and_serve_refuse_in_one_line(hub_saved, tmp_path, capsys, damage):
    folder = tmp_path / "model"
    shutil.copytree(hub_saved, folder)
    clean = tensors_of(folder)
    if damage == "nan-beside-index":
        shard(folder, halves(clean))
        clean[Q_PROJ][0, 0] = float("nan")
        save(clean, folder / "model.safetensors")
        words = "holds both"
    elif damage == "two-layers-under-one":
        edit_config(folder, num_hidden_layers=1)
        words = "the weights hold 2 layers"
    elif damage in ("int-tensor", "bool-tensor"):
        clean[Q_PROJ] = torch.ones_like(clean[Q_PROJ], dtype=torch.int64 if damage == "int-tensor" else torch.bool)
        save(clean, folder / "model.safetensors")
        words = "Transformers would cast it"
    else:
        save(clean, tmp_path / "outside.safetensors")
        shard(folder, {}, {key: "../outside.safetensors" for key in clean})
        words = "not a file name inside the folder"
    text = tmp_path / "text.txt"
    text.write_text("the sea is wide and the fish are many.\n" * 40)
    capsys.readouterr()
    for argv in (["generate", str(folder), "--max-new-tokens", "2"], ["eval", str(folder), "--perplexity", str(text)],
                 ["export", str(folder), str(tmp_path / "out.onnx")],
                 ["serve", str(folder), "--port", str(free_port())]):
        assert main(argv) == 2, (damage, argv[0])
        assert words in one_line(capsys, argv[0]), (damage, argv[0])
    assert not (tmp_path / "out.onnx").exists()
