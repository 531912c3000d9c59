#!/usr/bin/env python3
"""cpfill's tokenizer against the Python `tokenizers` package (CTest tokenizer_matches_hf).

    tokenizer_check.py build/cpfill WORKDIR [--random N] [--seed S]
    tokenizer_check.py build/cpfill WORKDIR --smollm2   (CTest tokenizer_matches_hf_smollm2)

1. Trains a byte-level BPE tokenizer in the Llama 3 style (the Llama 3 Split pattern, Isolated,
   then ByteLevel without a prefix space or regex; ByteLevel decoder; Llama 3's 256 special tokens
   after the vocabulary; TemplateProcessing adding <|begin_of_text|>; ignore_merges) on a corpus
   this script generates: English, code, numbers, CJK, Arabic, Hebrew, Cyrillic, Devanagari, emoji,
   accented and combining characters, whitespace runs, newlines, tabs.
2. Saves it in six variants, each loaded by both sides from the same files: Llama 3's shape
   with merges as [a, b] pairs; the same with legacy "a b" merges; ignore_merges off with a bare
   TemplateProcessing; GPT-2's bare ByteLevel pre-tokenizer (use_regex) without a template; the
   merges shuffled, with and without ignore_merges (rank order and ignore_merges then decide).
3. Per variant, over a few thousand strings (edge cases, random mixes of the scripts and random
   code points of old Unicode blocks): `cpfill tokenize` ids against Python's encode, with and
   without BOS; and random id lists (some cutting multi-byte characters, so that U+FFFD
   replacement is exercised) decoded by both, with and without skip_special_tokens.
4. Encodes about 1 MB of mixed text with both and prints the timings (no limit asserted).

With --smollm2, the same comparison runs on a real vocabulary instead of a trained one: SmolLM2's
tokenizer.json as tests/models/convert_smollm2.py builds it with `tokenizers` (49,152 tokens,
48,900 merges, 17 special tokens, `continuing_subword_prefix: ""` as transformers writes it,
Digits then GPT-2's ByteLevel split), in four variants: as converted; the pre-tokenizer written
as llama.cpp's two regexes (Split \p{N}, Split GPT-2's pattern, ByteLevel without regex);
ignore_merges on; digit runs (Digits without individual_digits). The texts add ChatML turns and
SmolLM2's special tokens inside words.

Known differences, not tested: characters assigned after Unicode 14 (Debian 12's PCRE2 knows no
letters or digits there; tokenizers' Oniguruma does) and U+180E (whitespace to PCRE2 only).
Exit 0 when everything matches, 1 on any mismatch (each printed with the string and both ids).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time

try:
    import tokenizers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
except ImportError:
    print(f"FAIL: {sys.executable} has no `tokenizers` package: run launch/setup.sh (it makes "
          ".venv) or configure with -DCPFILL_PYTHON=<a python with tokenizers>")
    sys.exit(1)

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Llama 3.1's special tokens, in id order after the vocabulary.
SPECIAL = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
            "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
            "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"] +
           [f"<|reserved_special_token_{i}|>" for i in range(3, 248)])
# Added tokens beyond Llama 3's: one special with spaces (decoded from its own UTF-8, not byte
# level), one plain (not special: kept by skip_special_tokens; normalized: matched second).
EXTRA_SPECIAL = "<|fim middle token|>"
PLAIN_ADDED = "<tool>"

# ---- text ----------------------------------------------------------------------------------

WORDS = ("the of and to in is was for that with as on by at from his her they we you this be "
         "are have not but had which one all were when there can an been has more who will no "
         "if out so said what up its about into than them only other time new some could these "
         "two may first then do any like my now over such our man me even most made after also "
         "did many before must through back years where much your way well down should because "
         "each just those people how too little state good very make world still own see men "
         "work long get here between both life being under never day same another know while "
         "last might us great old year off come since against go came right used take three "
         "Tokenizer BPE Merge Llama Context Parallel Prefill GPU Attention").split()
CONTRACTIONS = ["don't", "it's", "IT'S", "It'S", "we're", "WE'RE", "they'll", "I'd", "you've",
                "I'M", "she'd", "THEY'LL", "won't", "o'clock", "'s", "''s", "rock'n'roll"]
CODE = ["def f(x):\n    return x + 1\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
        "#include <stdio.h>\n", "x = [1, 2, 3]  # list", "if a != b and c >= d:", "// comment",
        "std::vector<int32_t> ids;", "SELECT * FROM t WHERE id=42;", "<div class=\"a\">x</div>",
        "λx. x + 1", "a->b", "x ** 2", "f\"{name!r}\"", "0x1F", "`code`", "$HOME/bin:$PATH"]
CJK = ["的一是不了人我在有他这为之大来以个中上们", "こんにちは世界", "カタカナ", "東京都",
       "안녕하세요", "한국어", "中文分词测试", "漢字仮名交じり文"]
ARABIC = ["مرحبا بالعالم", "السلام عليكم", "١٢٣٤٥", "كتاب", "שלום עולם", "עברית"]
OTHER = ["Привет, мир", "Ελληνικά", "नमस्ते दुनिया", "हिन्दी", "สวัสดีครับ", "ქართული",
         "Հայերեն", "Tiếng Việt"]
EMOJI = ["😀", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "🇫🇷", "❤️", "🎉🎉", "🤖", "✨", "🙂\u200d↕️"]
ACCENTED = ["café", "naïve", "Ångström", "straße", "ÉCOLE", "façade", "São Paulo", "Øresund",
            "e\u0301", "a\u0308", "n\u0303o", "\u0301", "a\u0301\u0301\u0301", "ǅ", "ﬁ", "Ⅻ",
            "²³", "½"]
SPACES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", " \n ",
          "\u00a0", "\u3000", "\u2003", "\u2028", "\u0085", "\v", "\f", " \t \n"]
PUNCT = ["...", "!!!", "?!", "—", "“quoted”", "«»", "()[]{}", "—–-", "…", "@#%&*", "'", "''",
         "\"", ";:", ",", "•", "→", "™", "€100", "$5.00", "50%"]

# Blocks assigned well before Unicode 14, for random code points (see "Known differences").
OLD_BLOCKS = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x530, 0x58F),
              (0x590, 0x5FF), (0x600, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x10A0, 0x10FF),
              (0x1E00, 0x1EFF), (0x2000, 0x206F), (0x2070, 0x209F), (0x20A0, 0x20BF),
              (0x2100, 0x214F), (0x2190, 0x23FF), (0x2500, 0x27BF), (0x3000, 0x30FF),
              (0x4E00, 0x9FA5), (0xAC00, 0xD7A3), (0xFB00, 0xFB4F), (0xFE30, 0xFE4F),
              (0xFF00, 0xFFEF), (0x1F300, 0x1F5FF), (0x1F600, 0x1F64F), (0x1D400, 0x1D7FF)]

EDGE_CASES = [
    "", " ", "    ", "\t", "\n", "\r", "\r\n", "\r\n\r\n", " \r\n ", "a\n\nb", "   a", "a   ",
    "a  b", "a \n b", "\n\n\n\nx", "x\n \n", "1234567", "12345678901234567890", "1 234", "3.14",
    "١٢٣٤", "²³", "Ⅻ", "-1", "+1", "10,000", "it's", "IT'S", "It'S", "we're", "WE'RE", "they'll",
    "I'd", "you've", "I'M", "don't", "'s", "''s", "'ſ", "'K", "x'S", "<|begin_of_text|>",
    "<|begin_of_text|>Hello", "a<|end_of_text|>b", "<|begin_of_text|><|begin_of_text|>",
    "<|begin_of_text", "<|eot_id|>\n\n", "<|reserved_special_token_247|>",
    "x <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", "<tool> x", "x<tool>y",
    EXTRA_SPECIAL, "a " + EXTRA_SPECIAL + " b", "<|", "|>", "<|>", "\ufffd", "\U0010ffff",
    "\U0001f600", "\u200d", "a\u200db", "👨\u200d👩\u200d👧", "\ufeff", "\ufeffx", "\x00",
    "a\x00b", "\x01\x7f", "\ue000", "\ufdd0", "\u00a0", "\u3000", "\u2028", "\u0085", "a\u00a0b",
    " \u00a0 ", "e\u0301", "\u0301", "a\u0301\u0301", "n\u0303o", "مرحبا", "שלום",
    "नमस्ते", "Ελληνικά", "a" * 5000, " " * 3000, "1" * 1000, "\n" * 500, "ab " * 700,
    "Hello, world! How are you today?", "THE QUICK BROWN FOX", "ÀÉÎÕÜ àéîõü",
]


def random_text(rng):
    pools = [WORDS, WORDS, WORDS, CONTRACTIONS, CODE, CJK, ARABIC, OTHER, EMOJI, ACCENTED,
             SPACES, PUNCT]
    parts = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        if kind < 0.1:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
        elif kind < 0.18:
            lo, hi = rng.choice(OLD_BLOCKS)
            parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6))))
        elif kind < 0.22:
            parts.append(rng.choice(SPECIAL[:12] + [EXTRA_SPECIAL, PLAIN_ADDED]))
        else:
            word = rng.choice(rng.choice(pools))
            parts.append(word.capitalize() if rng.random() < 0.15 else word)
        parts.append(rng.choice(["", " ", " ", " ", "  ", "\n", "\t", "\r\n", ", ", ". "]))
    return "".join(parts)


def corpus(rng, lines):
    return [random_text(rng) for _ in range(lines)]


# ---- tokenizers ----------------------------------------------------------------------------

def train(rng, vocab_size=2000):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(rng, 4000), trainer)
    return json.loads(tok.to_str())


def added(content, token_id, special=True):
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": not special, "special": special}


def llama3_shape(trained):
    """Llama 3's tokenizer.json layout around the trained vocabulary and merges."""
    t = json.loads(json.dumps(trained))
    n = len(t["model"]["vocab"])
    t["added_tokens"] = ([added(c, n + i) for i, c in enumerate(SPECIAL)] +
                         [added(EXTRA_SPECIAL, n + len(SPECIAL)),
                          added(PLAIN_ADDED, n + len(SPECIAL) + 1, special=False)])
    t["model"]["ignore_merges"] = True
    bos = SPECIAL[0]
    template = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos, "type_id": 1}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [n], "tokens": [bos]}}}
    t["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
         "use_regex": True}, template]}
    return t


def variants(trained, rng):
    base = llama3_shape(trained)
    legacy = json.loads(json.dumps(base))
    legacy["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m
                                 for m in legacy["model"]["merges"]]
    no_ignore = json.loads(json.dumps(base))
    no_ignore["model"]["ignore_merges"] = False
    no_ignore["post_processor"] = base["post_processor"]["processors"][1]
    gpt2 = json.loads(json.dumps(base))
    gpt2["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False,
                             "trim_offsets": True, "use_regex": True}
    gpt2["post_processor"] = None
    # A trained BPE rebuilds its own words, so ignore_merges rarely changes anything; with the
    # merges shuffled, rank order decides every segmentation and ignore_merges often does.
    shuffled = json.loads(json.dumps(base))
    rng.shuffle(shuffled["model"]["merges"])
    shuffled_no_ignore = json.loads(json.dumps(shuffled))
    shuffled_no_ignore["model"]["ignore_merges"] = False
    return {"llama3-pairs": base, "llama3-legacy-merges": legacy,
            "no-ignore-merges": no_ignore, "gpt2-bytelevel": gpt2,
            "shuffled-merges": shuffled, "shuffled-merges-no-ignore": shuffled_no_ignore}


# ---- SmolLM2: a real vocabulary ------------------------------------------------------------

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
SMOLLM2_SPECIAL_TEXTS = [
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n", "x<|im_end|>y", "<|endoftext|><|endoftext|>", "<|im_start|", "<repo_name>a/b",
    "<file_sep><filename>x.py\n", "a <jupyter_code> b", "<gh_stars>1000", "<|im_end|>\n\n\n",
    "Paris is 2,148,271 people; 3.14159 and 1e-5.", "x1y22z333", "٣٤ ²³ Ⅻ ½", "  1  22   333",
]


def smollm2_variants(directory):
    with open(os.path.join(directory, "tokenizer.json"), encoding="utf-8") as f:
        base = json.load(f)
    if base["model"].get("continuing_subword_prefix") != "":
        print("FAIL: the converted SmolLM2 tokenizer.json lost its continuing_subword_prefix \"\"")
    regexes = json.loads(json.dumps(base))
    regexes["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{N}"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": GPT2_PATTERN}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}
    ignore = json.loads(json.dumps(base))
    ignore["model"]["ignore_merges"] = True
    runs = json.loads(json.dumps(base))
    runs["pre_tokenizer"]["pretokenizers"][0]["individual_digits"] = False
    return {"smollm2": base, "smollm2-llama.cpp-regexes": regexes,
            "smollm2-ignore-merges": ignore, "smollm2-digit-runs": runs}


def check_smollm2(args, rng):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "models"))
    import convert_smollm2
    checkpoint = convert_smollm2.require_checkpoint()
    with open(os.path.join(checkpoint, "tokenizer_config.json")) as f:
        config = json.load(f)
    texts = EDGE_CASES + SMOLLM2_SPECIAL_TEXTS + corpus(rng, args.random)
    bad, lists_total = 0, 0
    for name, tokenizer_json in smollm2_variants(checkpoint).items():
        directory = os.path.join(args.workdir, name)
        tok = save(directory, tokenizer_json, config)
        lists = id_lists(tok, rng, texts)
        bad += compare(name, tok, args.cpfill, directory, texts, lists)
        lists_total += len(lists)
    print(f"tokenizer_check --smollm2: tokenizers {tokenizers.__version__}, {len(texts)} strings "
          f"x 2 and {lists_total} id lists x 2 over 4 variants of SmolLM2's vocabulary: {bad} "
          f"mismatches -> {'OK' if bad == 0 else 'FAIL'}")
    return 0 if bad == 0 else 1


def save(directory, tokenizer_json, config=None):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_json, f, ensure_ascii=False)
    config = config or {
        "bos_token": SPECIAL[0],
        "eos_token": {"__type": "AddedToken", "content": SPECIAL[1], "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False},
        "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))


# ---- id lists to decode --------------------------------------------------------------------

def byte_ids(tok):
    """Ids of the 256 single-byte tokens, in byte order (GPT-2's alphabet); None for a byte
    the vocabulary lacks (SmolLM2 has no token for bytes that never occur in UTF-8)."""
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or b >= 174]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [tok.token_to_id(chars[b]) for b in range(256)]


def id_lists(tok, rng, texts):
    size = tok.get_vocab_size(with_added_tokens=True)
    lists = [[]]
    lists += [[rng.randrange(size) for _ in range(rng.randint(1, 16))] for _ in range(800)]
    for _ in range(600):  # slices of real encodings: cut characters
        ids = tok.encode(rng.choice(texts), add_special_tokens=False).ids
        if ids:
            i = rng.randrange(len(ids))
            lists.append(ids[i:rng.randint(i + 1, len(ids))])
    b = byte_ids(tok)
    for pattern in [b"\xe0\x80", b"\xed\xa0\x80", b"\xf0\x9f\x98", b"\xc0\xaf", b"\xf4\x90\x80\x80",
                    b"\x80", b"\xff", b"\xe2\x82A", b"\xf0\x90\x80\xf0", b"a\xe2\x82\xacb",
                    b"\xe1\x80\xe2\xf0\x91\x92\xf1\xbfA", b"\xed\x9f\xbf", b"\xef\xbf\xbf"]:
        if all(b[x] is not None for x in pattern):
            lists.append([b[x] for x in pattern])
    present = [i for i in b if i is not None]
    for _ in range(300):  # random bytes
        lists.append([rng.choice(present) for _ in range(rng.randint(1, 12))])
    return lists


# ---- comparing -----------------------------------------------------------------------------

def cpfill_tokenize(cpfill, directory, texts, lists, no_bos, skip_special):
    texts_path = os.path.join(directory, "texts.json")
    lists_path = os.path.join(directory, "ids.json")
    out_path = os.path.join(directory, "out.json")
    with open(texts_path, "w") as f:
        json.dump(texts, f)
    with open(lists_path, "w") as f:
        json.dump(lists, f)
    argv = [cpfill, "tokenize", "--model", directory, "--texts", texts_path, "--decode",
            lists_path, "--json", out_path]
    argv += ["--no-bos"] if no_bos else []
    argv += ["--skip-special"] if skip_special else []
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"FAIL: {' '.join(argv)} exited {p.returncode}: {p.stderr.strip()}")
        return None
    with open(out_path) as f:
        return json.load(f)


def compare(name, tok, cpfill, directory, texts, lists):
    """Mismatch count; each printed with its input and both results (the first 10 in full)."""
    bad = 0
    for no_bos, skip in [(False, False), (True, True)]:
        out = cpfill_tokenize(cpfill, directory, texts, lists, no_bos, skip)
        if out is None:
            return 1
        want_ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=not no_bos)]
        for text, want, got in zip(texts, want_ids, out["ids"]):
            if want != got:
                bad += 1
                if bad <= 10:
                    print(f"MISMATCH [{name}, bos={not no_bos}] encode {text[:200]!r}\n"
                          f"  tokenizers: {want}\n  cpfill:     {got}")
        want_texts = tok.decode_batch(lists, skip_special_tokens=skip)
        for ids, want, got in zip(lists, want_texts, out["texts"]):
            if want != got:
                bad += 1
                if bad <= 10:
                    print(f"MISMATCH [{name}, skip_special={skip}] decode {ids}\n"
                          f"  tokenizers: {want!r}\n  cpfill:     {got!r}")
    print(f"{name}: {len(texts)} strings encoded (with and without BOS), {len(lists)} id lists "
          f"decoded (with and without skip_special): {bad} mismatches")
    return bad


def timing(cpfill, directory, tok, rng):
    """About 1 MB of mixed text through both; prints the times and checks the ids agree."""
    parts, size = [], 0
    while size < 1 << 20:
        parts.append(random_text(rng))
        size += len(parts[-1].encode())
    text = "".join(parts)
    path = os.path.join(directory, "big.json")
    with open(path, "w") as f:
        json.dump([text], f)
    out_path = os.path.join(directory, "big_out.json")
    start = time.perf_counter()
    p = subprocess.run([cpfill, "tokenize", "--model", directory, "--texts", path, "--no-bos",
                        "--json", out_path], capture_output=True, text=True)
    cpfill_s = time.perf_counter() - start
    if p.returncode != 0:
        print(f"FAIL: cpfill tokenize of 1 MB exited {p.returncode}: {p.stderr.strip()}")
        return 1
    start = time.perf_counter()
    want = tok.encode(text, add_special_tokens=False).ids
    python_s = time.perf_counter() - start
    with open(out_path) as f:
        got = json.load(f)["ids"][0]
    print(f"timing: {size / 1e6:.2f} MB, {len(want)} tokens: cpfill tokenize {cpfill_s:.3f} s "
          f"(the whole process: start, load, JSON in and out), tokenizers encode {python_s:.3f} s")
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                     min(len(got), len(want)))
        print(f"MISMATCH [1 MB text] first difference at token {first}: "
              f"tokenizers {want[first:first + 8]}, cpfill {got[first:first + 8]}")
        return 1
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cpfill")
    ap.add_argument("workdir")
    ap.add_argument("--random", type=int, default=2500, help="random strings per variant")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--smollm2", action="store_true",
                    help="compare on SmolLM2's real vocabulary (converted if not cached)")
    args = ap.parse_args()
    version = tuple(int(x) for x in tokenizers.__version__.split(".")[:2])
    if version < (0, 20):
        print(f"FAIL: tokenizers {tokenizers.__version__} is too old (0.20 or later: "
              "ignore_merges, merges as pairs); run launch/setup.sh")
        return 1
    rng = random.Random(args.seed)
    if args.smollm2:
        return check_smollm2(args, rng)
    trained = train(rng)
    texts = EDGE_CASES + corpus(rng, args.random)
    bad, strings, lists_total = 0, 0, 0
    for name, tokenizer_json in variants(trained, rng).items():
        directory = os.path.join(args.workdir, name)
        tok = save(directory, tokenizer_json)
        lists = id_lists(tok, rng, texts)
        bad += compare(name, tok, args.cpfill, directory, texts, lists)
        strings += len(texts)
        lists_total += len(lists)
    bad += timing(args.cpfill, os.path.join(args.workdir, "llama3-pairs"),
                  Tokenizer.from_file(os.path.join(args.workdir, "llama3-pairs",
                                                   "tokenizer.json")), rng)
    print(f"tokenizer_check: tokenizers {tokenizers.__version__}, {strings} strings x 2 and "
          f"{lists_total} id lists x 2 over 6 variants: {bad} mismatches -> "
          f"{'OK' if bad == 0 else 'FAIL'}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
