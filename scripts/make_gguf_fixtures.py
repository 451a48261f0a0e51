#!/usr/bin/env python3
"""Generate the GGUF and quantization fixtures under tests/fixtures/gguf/.

Run from the repository root:

    python scripts/make_gguf_fixtures.py --llama-cpp-sdist DIR/llama_cpp_python-0.3.36.tar.gz

in a virtualenv with `gguf` (0.19.0 made the committed files), numpy and safetensors, on a
machine with gcc and g++. See scripts/README.md ("GGUF fixtures") for how to fetch the sdist.

References:
  * Q8_0 / Q4_0 quantization and all dequantization: the `gguf` PyPI package (llama.cpp's
    Python GGUF library, numpy implementations of the GGML formats).
  * Q4_K / Q6_K quantization: the `gguf` package has none, so the script builds GGML's C
    library (ggml-base: ggml-quants.c and friends) from the llama.cpp sources vendored in
    the llama-cpp-python sdist and calls `quantize_row_q4_K_ref` / `quantize_row_q6_K_ref`
    (the reference quantizers `llama-quantize` uses without an importance matrix) through
    ctypes. It is compiled with -O2 -ffp-contract=off: GGML's reference code is plain f32
    arithmetic, and llama.cpp's own x86-64 builds cannot fuse multiply-adds in it either
    (its CMake gives -march flags only to the CPU backend, not to ggml-base, which holds
    ggml-quants.c and the ggml_quantize_chunk that llama-quantize calls).
  * Every reference is cross-checked before anything is written: the package's Q8_0/Q4_0
    quantizers against the C reference quantizers, and the package's dequantizers against the
    C `dequantize_row_*`, bit for bit.

Outputs (deterministic: a re-run reproduces byte-identical files):
  quant_vectors.safetensors   for each type in Q8_0, Q4_0, Q4_K, Q6_K and each case:
      {type}.{case}.x  f32 [n]      input (absent for `randbytes`)
      {type}.{case}.q  u8  [bytes]  reference quantization of x (random blocks for `randbytes`)
      {type}.{case}.y  f32 [n]      reference dequantization of q
  fixture.gguf                written by gguf.GGUFWriter: metadata of every value type
                              (arrays of each, a nested array, empty and non-ASCII strings,
                              extreme integers) and tensors of F32/F16/BF16/Q8_0/Q4_0/Q4_K/Q6_K
                              with odd row counts and 0 to 4 dimensions
  aligned64.gguf              a small file with general.alignment = 64
  fixture.json                what each .gguf holds: version, alignment, data offset, every
                              metadata value (floats as IEEE bit patterns) and tensor infos,
                              as read back by gguf.GGUFReader
  fixture_values.safetensors  every tensor of both files dequantized to f32 (row-major shape)

`--check-strix-dir DIR` instead reads GGUF files written by strix (the round-trip test in
crates/strix/tests/gguf.rs leaves them in $STRIX_GGUF_KEEP_DIR) with gguf.GGUFReader and
llama.cpp's own C reader (gguf_init_from_file), and dequantizes their tensors with the
package to compare against the f32 values strix stored beside them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from safetensors.numpy import load_file, save_file

OUT = Path("tests/fixtures/gguf")
REF_GGUF = "0.19.0"
SEED = 20260415

BLOCK = {T.Q8_0: (32, 34), T.Q4_0: (32, 18), T.Q4_K: (256, 144), T.Q6_K: (256, 210)}
C_NAME = {T.Q8_0: "q8_0", T.Q4_0: "q4_0", T.Q4_K: "q4_K", T.Q6_K: "q6_K"}


# --------------------------------------------------------------------------------------
# GGML's C reference, built from the llama.cpp sources in the llama-cpp-python sdist


def build_ggml(sdist: Path, work: Path) -> ctypes.CDLL:
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/ggml/" in m.name]
        if not members:
            sys.exit(f"{sdist}: no vendor/llama.cpp/ggml/ inside; is it the llama-cpp-python sdist?")
        tar.extractall(work, members=members, filter="data")
    ggml = next(work.glob("*/vendor/llama.cpp/ggml"))
    (work / "ggml-version.h").write_text('#pragma once\n#define GGML_VERSION "0"\n#define GGML_COMMIT "0"\n')
    flags = ["-O2", "-fPIC", "-ffp-contract=off", "-DNDEBUG", "-D_GNU_SOURCE",
             f"-I{ggml}/include", f"-I{ggml}/src", f"-I{work}"]
    objs = []
    for src in ["ggml.c", "ggml-alloc.c", "ggml-quants.c", "ggml.cpp", "ggml-backend.cpp",
                "ggml-backend-meta.cpp", "ggml-opt.cpp", "ggml-threading.cpp", "gguf.cpp"]:
        path = ggml / "src" / src
        if not path.exists():
            continue
        obj = work / (src + ".o")
        cc = ["gcc", "-std=gnu11"] if src.endswith(".c") else ["g++", "-std=gnu++17"]
        subprocess.run(cc + flags + ["-c", str(path), "-o", str(obj)], check=True, stderr=subprocess.DEVNULL)
        objs.append(str(obj))
    lib = work / "libggml-base.so"
    subprocess.run(["g++", "-shared", "-o", str(lib)] + objs + ["-lm", "-lpthread"], check=True)
    dll = ctypes.CDLL(str(lib))
    for t in BLOCK:
        for fn in (f"quantize_row_{C_NAME[t]}_ref", f"dequantize_row_{C_NAME[t]}"):
            getattr(dll, fn).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
            getattr(dll, fn).restype = None
    return dll


def c_row(dll, fn: str, src: np.ndarray, src_dtype, out_dtype, out_size) -> np.ndarray:
    """GGML's row function `fn(src, out, n)` on a flat copy of `src`, into `out_size(src.size)`
    elements of `out_dtype`; `n` counts the float values (whichever side holds them)."""
    src = np.ascontiguousarray(src, dtype=src_dtype).reshape(-1)
    out = np.zeros(out_size(src.size), out_dtype)
    getattr(dll, fn)(src.ctypes.data, out.ctypes.data, src.size if src_dtype == np.float32 else out.size)
    return out


def c_quantize(dll, t: T, x: np.ndarray) -> np.ndarray:
    bs, ts = BLOCK[t]
    return c_row(dll, f"quantize_row_{C_NAME[t]}_ref", x, np.float32, np.uint8, lambda n: n // bs * ts)


def c_dequantize(dll, t: T, q: np.ndarray) -> np.ndarray:
    bs, ts = BLOCK[t]
    return c_row(dll, f"dequantize_row_{C_NAME[t]}", q, np.uint8, np.float32, lambda n: n // ts * bs)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def reference_quantize(dll, t: T, x: np.ndarray) -> np.ndarray:
    """The C reference quantizer, checked against the gguf package where it has one."""
    q = c_quantize(dll, t, x)
    if t in (T.Q8_0, T.Q4_0):
        bs, ts = BLOCK[t]
        qp = gguf.quants.quantize(x.reshape(-1, bs), t).reshape(-1)
        assert np.array_equal(qp, q), f"{t.name}: gguf package and C reference quantizers differ"
    return q


def reference_dequantize(dll, t: T, q: np.ndarray) -> np.ndarray:
    """The gguf package's dequantization, checked against the C reference bit for bit."""
    bs, ts = BLOCK[t]
    y = gguf.quants.dequantize(q.reshape(-1, ts), t).reshape(-1).astype(np.float32)
    assert same_bits(y, c_dequantize(dll, t, q)), f"{t.name}: gguf package and C dequantizers differ"
    return y


# --------------------------------------------------------------------------------------
# Quantization vectors


def quant_cases(t: T, rng: np.random.Generator) -> dict[str, np.ndarray]:
    bs = BLOCK[t][0]
    n_random = 8 if bs == 256 else 32
    normal = lambda n=bs: rng.standard_normal(n).astype(np.float32)  # noqa: E731
    # Per-block magnitudes from 1e-3 to 10, so the f16 scales span a wide range.
    mags = (10.0 ** rng.uniform(-3, 1, n_random)).astype(np.float32)
    cases = {
        "random": (normal(n_random * bs).reshape(n_random, bs) * mags[:, None]).reshape(-1),
        "zeros": np.zeros(bs, np.float32),
        # Scales in f16's subnormal range, and below it (they round to zero).
        "tiny": normal() * np.float32(1e-5),
        "tinier": normal() * np.float32(1e-8),
        "outlier": normal(),
        "negative": -np.abs(normal()) - np.float32(0.01),
        "positive": np.abs(normal()) + np.float32(0.5),
        "constant": np.full(bs, 0.75, np.float32),
        "large": normal() * np.float32(1000.0),
        "ramp": np.linspace(-1.0, 1.0, bs, dtype=np.float32),
    }
    cases["outlier"][bs // 3] = np.float32(1000.0)
    if bs == 32:
        # x·(1/d) lands on exact halves: round-half-away-from-zero and truncation cases.
        ties = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] + [0.25 * i for i in range(24)], np.float32)
        cases["ties"] = ties
    else:
        # Sub-blocks of zeros between random ones: the requantization skips zero scales.
        mixed = normal()
        mixed[32:64] = 0
        mixed[128:160] = 0
        mixed[200:216] = 0
        cases["mixed"] = mixed
    return cases


def random_blocks(t: T, rng: np.random.Generator, n: int) -> np.ndarray:
    """Arbitrary bytes, with the f16 scale fields set to finite values."""
    bs, ts = BLOCK[t]
    q = rng.integers(0, 256, size=(n, ts), dtype=np.uint8)
    f16 = lambda: (rng.uniform(-2, 2, n) * 10.0 ** rng.uniform(-4, 0, n)).astype(np.float16).view(np.uint8).reshape(n, 2)  # noqa: E731
    if t in (T.Q8_0, T.Q4_0):
        q[:, 0:2] = f16()
    elif t == T.Q4_K:
        q[:, 0:2] = f16()
        q[:, 2:4] = f16()
    elif t == T.Q6_K:
        q[:, 208:210] = f16()
    return q.reshape(-1)


def make_quant_vectors(dll, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for t in BLOCK:
        name = t.name.lower()
        for case, x in quant_cases(t, rng).items():
            q = reference_quantize(dll, t, x)
            out[f"{name}.{case}.x"] = x
            out[f"{name}.{case}.q"] = q
            out[f"{name}.{case}.y"] = reference_dequantize(dll, t, q)
        q = random_blocks(t, rng, 4 if BLOCK[t][0] == 256 else 16)
        out[f"{name}.randbytes.q"] = q
        out[f"{name}.randbytes.y"] = reference_dequantize(dll, t, q)
    return out


# --------------------------------------------------------------------------------------
# GGUF files


def add_metadata(w: GGUFWriter) -> None:
    V = GGUFValueType
    w.add_key_value("test.u8", 255, V.UINT8)
    w.add_key_value("test.i8", -128, V.INT8)
    w.add_key_value("test.u16", 65535, V.UINT16)
    w.add_key_value("test.i16", -32768, V.INT16)
    w.add_key_value("test.u32", 4294967295, V.UINT32)
    w.add_key_value("test.i32", -2147483648, V.INT32)
    w.add_key_value("test.f32", 3.14159, V.FLOAT32)
    w.add_key_value("test.u64", 2**64 - 1, V.UINT64)
    w.add_key_value("test.i64", -(2**63), V.INT64)
    w.add_key_value("test.f64", -1.5e300, V.FLOAT64)
    w.add_key_value("test.bool_true", True, V.BOOL)
    w.add_key_value("test.bool_false", False, V.BOOL)
    w.add_key_value("test.string", "Grüße, 世界 🦀\n\"quoted\"", V.STRING)
    w.add_key_value("test.empty_string", "", V.STRING)
    w.add_key_value("test.arr.u8", [0, 1, 255], V.ARRAY, sub_type=V.UINT8)
    w.add_key_value("test.arr.i8", [-128, 0, 127], V.ARRAY, sub_type=V.INT8)
    w.add_key_value("test.arr.u16", [0, 65535], V.ARRAY, sub_type=V.UINT16)
    w.add_key_value("test.arr.i16", [-32768, 32767], V.ARRAY, sub_type=V.INT16)
    w.add_key_value("test.arr.u32", [0, 7, 4294967295], V.ARRAY, sub_type=V.UINT32)
    w.add_key_value("test.arr.i32", [-5, 0, 2147483647], V.ARRAY, sub_type=V.INT32)
    w.add_key_value("test.arr.f32", [0.5, -1e-3, 1e30], V.ARRAY, sub_type=V.FLOAT32)
    w.add_key_value("test.arr.u64", [2**64 - 1, 0], V.ARRAY, sub_type=V.UINT64)
    w.add_key_value("test.arr.i64", [-(2**63), 2**63 - 1], V.ARRAY, sub_type=V.INT64)
    w.add_key_value("test.arr.f64", [2.5, -0.1], V.ARRAY, sub_type=V.FLOAT64)
    w.add_key_value("test.arr.bool", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    w.add_key_value("test.arr.string", ["a", "", "ü🦀", "<|im_end|>"], V.ARRAY, sub_type=V.STRING)
    w.add_key_value("test.arr.nested", [[1, 2, 3], [4], [-5, 6]], V.ARRAY)
    # The keys a Qwen3.5 file carries, in the types llama.cpp's converter writes them.
    w.add_name("strix fixture")
    w.add_block_count(3)
    w.add_context_length(4096)
    w.add_rope_freq_base(10000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["!", "\"", "Ġthe", "<|endoftext|>"])
    w.add_token_types([1, 1, 1, 3])
    w.add_token_scores([0.0, -1.0, -2.5, 0.0])
    w.add_token_merges(["Ġ t", "h e"])
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.add_quantization_version(2)


def fixture_tensors(rng: np.random.Generator) -> list[tuple[str, T, np.ndarray]]:
    """(name, type, f32 values with numpy (row-major) shape) for fixture.gguf."""
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return [
        ("f32.scalar", T.F32, np.array(2.5, np.float32)),
        ("f32.vec", T.F32, normal(7)),
        ("f32.cube", T.F32, normal(2, 3, 4)),
        ("f32.4d", T.F32, normal(1, 3, 1, 2)),
        ("f16.mat", T.F16, normal(5, 3)),
        ("bf16.mat", T.BF16, normal(7, 5)),
        ("q8_0.mat", T.Q8_0, normal(5, 64)),
        ("q4_0.mat", T.Q4_0, normal(3, 96)),
        ("q4_k.mat", T.Q4_K, normal(3, 512) * np.float32(0.1)),
        ("blk.0.ffn_down.weight", T.Q6_K, normal(5, 256)),
    ]


def encode(dll, t: T, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes shaped [.., row bytes] for GGUFWriter, f32 values the file then holds)."""
    if t == T.F32:
        return x, x
    if t == T.F16:
        h = x.astype(np.float16)
        return h, h.astype(np.float32)
    if t == T.BF16:
        q = gguf.quants.quantize(x, T.BF16)
        return q, gguf.quants.dequantize(q, T.BF16).astype(np.float32).reshape(x.shape)
    q = reference_quantize(dll, t, x).reshape(*x.shape[:-1], -1)
    return q, reference_dequantize(dll, t, q).reshape(x.shape)


def write_gguf(path: Path, dll, tensors, metadata: bool, alignment: int | None) -> dict[str, np.ndarray]:
    w = GGUFWriter(path, "qwen35")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    if metadata:
        add_metadata(w)
    values = {}
    for name, t, x in tensors:
        data, y = encode(dll, t, x)
        w.add_tensor(name, data, raw_dtype=None if t in (T.F32, T.F16) else t)
        values[name] = np.array(y, dtype=np.float32, order="C")  # (ascontiguousarray makes 0-d 1-d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


TYPE_NAMES = {
    GGUFValueType.UINT8: "u8", GGUFValueType.INT8: "i8", GGUFValueType.UINT16: "u16", GGUFValueType.INT16: "i16",
    GGUFValueType.UINT32: "u32", GGUFValueType.INT32: "i32", GGUFValueType.FLOAT32: "f32",
    GGUFValueType.BOOL: "bool", GGUFValueType.STRING: "string", GGUFValueType.ARRAY: "array",
    GGUFValueType.UINT64: "u64", GGUFValueType.INT64: "i64", GGUFValueType.FLOAT64: "f64",
}


def json_scalar(v, vtype: GGUFValueType):
    """Floats as IEEE bit patterns (nothing lost to decimal), 64-bit integers as strings."""
    V = GGUFValueType
    if vtype == V.FLOAT32:
        return int(np.float32(v).view(np.uint32))
    if vtype == V.FLOAT64:
        return str(int(np.float64(v).view(np.uint64)))
    if vtype in (V.UINT64, V.INT64):
        return str(int(v))
    if vtype == V.BOOL:
        return bool(v)
    return v if vtype == V.STRING else int(v)


def describe_value(v, vtype: GGUFValueType, sub) -> dict:
    if vtype != GGUFValueType.ARRAY:
        return {"type": TYPE_NAMES[vtype], "value": json_scalar(v, vtype)}
    if sub[0] == GGUFValueType.ARRAY:
        return {"type": "array", "element_type": "array",
                "value": [describe_value(x, GGUFValueType.ARRAY, sub[1:]) for x in v]}
    return {"type": "array", "element_type": TYPE_NAMES[sub[0]], "value": [json_scalar(x, sub[0]) for x in v]}


def field_value(field):
    """Value, type and element type path of a GGUFReader field, read independently of strix."""
    V = GGUFValueType
    types = list(field.types)

    def scalar(part, t):
        if t == V.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if types[0] != V.ARRAY:
        return scalar(field.parts[field.data[0]], types[0]), types[0], []
    if types[1] == V.ARRAY:
        # GGUFReader flattens nested arrays; re-read them from the raw parts: key length,
        # key, ARRAY, element type, count, then per inner array its type, count and values.
        items, i = [], 5
        for _ in range(int(field.parts[4][0])):
            (sub,), (n,) = field.parts[i].tolist(), field.parts[i + 1].tolist()
            i += 2
            vals = []
            for _ in range(n):
                if sub == V.STRING:
                    vals.append(bytes(field.parts[i + 1]).decode("utf-8"))
                    i += 2
                else:
                    vals.append(field.parts[i].tolist()[0])
                    i += 1
            items.append(vals)
        inner = GGUFValueType(int(field.parts[5][0]))
        return items, V.ARRAY, [V.ARRAY, inner]
    return [scalar(field.parts[j], types[1]) for j in field.data], V.ARRAY, [types[1]]


def describe_file(path: Path) -> dict:
    r = GGUFReader(path)
    meta = []
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's pseudo-fields for the header
        value, vtype, sub = field_value(field)
        meta.append({"key": key, **describe_value(value, vtype, sub)})
    tensors = []
    for t in r.tensors:
        tensors.append({
            "name": t.name,
            "type": T(t.tensor_type).name,
            "dims": [int(d) for d in t.shape],  # GGUFReader keeps GGML order here
            "offset": int(t.data_offset - r.data_offset),
            "n_bytes": int(t.n_bytes),
        })
    alignment = r.alignment
    return {
        "file": path.name,
        "version": int(r.fields["GGUF.version"].parts[-1][0]),
        "alignment": int(alignment),
        "data_offset": int(r.data_offset),
        "file_size": path.stat().st_size,
        "metadata": meta,
        "tensors": tensors,
    }


def generate(sdist: Path) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        dll = build_ggml(sdist, Path(tmp))
        rng = np.random.default_rng(SEED)
        vectors = make_quant_vectors(dll, rng)
        save_file(vectors, str(OUT / "quant_vectors.safetensors"),
                  # One key: safetensors writes its metadata map in hash order, so several keys
                  # would make the header differ from run to run.
                  metadata={"source": f"gguf {gguf_version()}, {sdist.name}, seed {SEED}"})

        values = write_gguf(OUT / "fixture.gguf", dll, fixture_tensors(rng), metadata=True, alignment=None)
        small = [("a.f32", T.F32, rng.standard_normal(3).astype(np.float32)),
                 ("b.q8_0", T.Q8_0, rng.standard_normal((1, 32)).astype(np.float32)),
                 ("c.q4_0", T.Q4_0, rng.standard_normal((3, 32)).astype(np.float32))]
        values.update(write_gguf(OUT / "aligned64.gguf", dll, small, metadata=False, alignment=64))
        save_file(values, str(OUT / "fixture_values.safetensors"), metadata={"gguf": gguf_version()})

    desc = {"gguf": gguf_version(), "files": [describe_file(OUT / "fixture.gguf"), describe_file(OUT / "aligned64.gguf")]}
    (OUT / "fixture.json").write_text(dump_json(desc))
    for p in sorted(OUT.iterdir()):
        print(f"{p}: {p.stat().st_size} bytes")


def dump_json(desc: dict) -> str:
    """Indented, but one line per metadata pair and per tensor."""
    one = lambda x: json.dumps(x, ensure_ascii=False)  # noqa: E731
    lines = ["{", f' "gguf": {one(desc["gguf"])},', ' "files": [']
    for i, f in enumerate(desc["files"]):
        lines.append("  {")
        for k in ("file", "version", "alignment", "data_offset", "file_size"):
            lines.append(f"   {one(k)}: {one(f[k])},")
        for k in ("metadata", "tensors"):
            lines.append(f"   {one(k)}: [")
            lines += [f"    {one(x)}" + ("," if j + 1 < len(f[k]) else "") for j, x in enumerate(f[k])]
            lines.append("   ]" + ("," if k == "metadata" else ""))
        lines.append("  }" + ("," if i + 1 < len(desc["files"]) else ""))
    lines += [" ]", "}", ""]
    text = "\n".join(lines)
    assert json.loads(text) == desc
    return text


def gguf_version() -> str:
    from importlib.metadata import version
    v = version("gguf")
    if v != REF_GGUF:
        print(f"warning: gguf {v}, the committed fixtures were made with {REF_GGUF}", file=sys.stderr)
    return v


# --------------------------------------------------------------------------------------
# Checking files strix wrote


def check_strix_dir(directory: Path, sdist: Path | None) -> None:
    dll = None
    tmp = None
    if sdist is not None:
        tmp = tempfile.TemporaryDirectory()
        dll = build_ggml(sdist, Path(tmp.name))
        dll.gguf_init_from_file.restype = ctypes.c_void_p
        for fn in ("gguf_get_n_tensors", "gguf_get_n_kv"):
            getattr(dll, fn).restype = ctypes.c_int64
            getattr(dll, fn).argtypes = [ctypes.c_void_p]
        dll.gguf_get_data_offset.restype = ctypes.c_size_t
        dll.gguf_get_data_offset.argtypes = [ctypes.c_void_p]
        dll.gguf_get_tensor_name.restype = ctypes.c_char_p
        dll.gguf_get_tensor_name.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        dll.gguf_get_tensor_offset.restype = ctypes.c_size_t
        dll.gguf_get_tensor_offset.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        dll.gguf_free.argtypes = [ctypes.c_void_p]
    files = sorted(directory.glob("*.gguf"))
    if not files:
        sys.exit(f"{directory}: no .gguf files")
    for path in files:
        r = GGUFReader(path)
        values_path = path.with_suffix(".values.safetensors")
        expected = load_file(str(values_path)) if values_path.exists() else {}
        n_checked = 0
        for t in r.tensors:
            qt = T(t.tensor_type)
            if t.name not in expected:
                continue
            y = gguf.quants.dequantize(np.asarray(t.data), qt).astype(np.float32).reshape(-1)
            want = expected[t.name].reshape(-1)
            assert same_bits(y, want), f"{path}: tensor {t.name} ({qt.name}) dequantizes differently"
            n_checked += 1
        line = f"{path.name}: gguf.GGUFReader read {len(r.fields)} fields, {len(r.tensors)} tensors; " \
               f"{n_checked} dequantized bit-identically to strix"
        nested = [k for k, f in r.fields.items() if len(f.types) > 1 and f.types[1] == GGUFValueType.ARRAY]
        if dll is not None and nested:
            line += f"; not given to llama.cpp's reader, which refuses arrays of arrays ({', '.join(nested)})"
        elif dll is not None:
            # gguf_init_from_file(fname, {no_alloc = true, ctx = NULL}); the struct is passed by value.
            class Params(ctypes.Structure):
                _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]
            dll.gguf_init_from_file.argtypes = [ctypes.c_char_p, Params]
            ctx = dll.gguf_init_from_file(str(path).encode(), Params(True, None))
            assert ctx, f"{path}: llama.cpp's gguf_init_from_file rejected it"
            n_t, n_kv = dll.gguf_get_n_tensors(ctx), dll.gguf_get_n_kv(ctx)
            assert n_t == len(r.tensors)
            for i, t in enumerate(r.tensors):
                assert dll.gguf_get_tensor_name(ctx, i).decode() == t.name
                assert dll.gguf_get_data_offset(ctx) + dll.gguf_get_tensor_offset(ctx, i) == t.data_offset
            dll.gguf_free(ctx)
            line += f"; llama.cpp gguf_init_from_file: ok ({n_t} tensors, {n_kv} keys, offsets agree)"
        print(line)
    if tmp is not None:
        tmp.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp-sdist", type=Path, help="llama_cpp_python-*.tar.gz (for GGML's C reference)")
    ap.add_argument("--check-strix-dir", type=Path, help="check GGUF files strix wrote instead of generating")
    args = ap.parse_args()
    if args.check_strix_dir is not None:
        check_strix_dir(args.check_strix_dir, args.llama_cpp_sdist)
        return
    if args.llama_cpp_sdist is None:
        ap.error("--llama-cpp-sdist is required to generate the fixtures")
    generate(args.llama_cpp_sdist)


if __name__ == "__main__":
    main()
