"""The prompt sets of `spec_decode.py` (issue 39): chat conversations of one user turn each.

GROUNDED: the source text is in the prompt and the answer copies much of it (rewrite, rename,
quote, re-format, convert, annotate, continue, translate, fix): where prompt-lookup drafts are
accepted. CHAT: open questions with no source text, where they mostly are not. Each entry is
(name, user message).

SmolLM2-135M is small: it often echoes its source with a few changes rather than doing the
task well (the YAML comes back as JSON, the renamed variable keeps its name), but its greedy
answers to every grounded prompt here do copy long runs of their source: `spec_decode.py
--show` prints each answer and `lookup_tokens_per_step`, the tokens a verify step would keep
with drafts from an n-gram lookup (float32, k = 5, n = 2..5, 2026-12-06: grounded 1.9 to 4.9
per prompt, csv_to_json 2.6; chat 1.1 to 1.8).
"""

from __future__ import annotations

_PARAGRAPH = """\
The comittee met on tuesday to discuss the new recieving procedures for the warehouse. \
Several members beleived that the curent system was to slow, and that shipments were often \
left on the loading dock for hours before anyone noticed them. After a long discusion, the \
comittee agreed to hire two additional workers for the evening shift and to instal a bell \
that rings whenever a truck arrives. The changes will take efect at the begining of next \
month, and the comittee will review the results in the folowing quarter."""

_FUNCTION = """\
def summarize_orders(orders, tax_rate, discount_codes):
    tmp = 0.0
    count = 0
    skipped = []
    for order in orders:
        if order.get("status") == "cancelled":
            skipped.append(order["id"])
            continue
        price = order["price"] * order["quantity"]
        code = order.get("discount_code")
        if code in discount_codes:
            price = price * (1 - discount_codes[code])
        tmp += price
        count += 1
    if count == 0:
        return {"total": 0.0, "count": 0, "skipped": skipped}
    tax = tmp * tax_rate
    tmp = tmp + tax
    average = tmp / count
    report = {
        "total": round(tmp, 2),
        "tax": round(tax, 2),
        "count": count,
        "average": round(average, 2),
        "skipped": skipped,
    }
    if tmp > 1000:
        report["tier"] = "gold"
    elif tmp > 500:
        report["tier"] = "silver"
    else:
        report["tier"] = "bronze"
    return report"""

_PASSAGE = """\
The lighthouse at Point Arden was built in 1873 from granite quarried on the island itself. \
Its lamp was first lit on the night of the twelfth of October, and for ninety years a keeper \
and his family lived in the small house at its foot. In 1963 the light was automated, and the \
last keeper, Thomas Wren, left the island with his wife and two daughters. Today the tower is \
a museum, open from May to September, and visitors may climb its one hundred and twelve steps \
to the lantern room, where the original brass lens is still on display."""

_JSON = """\
{"server": {"host": "0.0.0.0", "port": 8080, "workers": 4, "timeout": 30},
 "database": {"engine": "postgresql", "host": "db.internal", "port": 5432,
              "name": "inventory", "user": "app", "pool_size": 10},
 "logging": {"level": "info", "file": "/var/log/app.log", "rotate": true},
 "features": {"search": true, "export": false, "beta_dashboard": false}}"""

_PEOPLE = """\
[{"name": "Alice Martin", "age": 34, "city": "Lyon", "role": "engineer"},
 {"name": "Bruno Silva", "age": 28, "city": "Porto", "role": "designer"},
 {"name": "Chen Wei", "age": 41, "city": "Taipei", "role": "manager"},
 {"name": "Dana Cohen", "age": 25, "city": "Haifa", "role": "analyst"},
 {"name": "Emeka Obi", "age": 37, "city": "Lagos", "role": "engineer"}]"""

_CSV = """\
id,product,category,price,stock
101,Desk Lamp,lighting,24.99,120
102,Office Chair,furniture,149.00,35
103,Notebook,stationery,3.50,800
104,Monitor Stand,furniture,39.95,60
105,USB Cable,electronics,7.25,450
106,Stapler,stationery,12.00,200"""

_CODE = """\
def parse_range(text, default_step):
    parts = text.split(":")
    start = int(parts[0])
    stop = int(parts[1])
    step = int(parts[2]) if len(parts) > 2 else default_step
    return list(range(start, stop, step))


def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value


def mean(values):
    return sum(values) / len(values)"""

_LIST = """\
1. Apple - a red or green fruit that grows on trees.
2. Banana - a long yellow fruit that grows in bunches.
3. Cherry - a small round red fruit with a stone inside.
4. Grape - a small green or purple fruit that grows in clusters.
5. Lemon - a sour yellow fruit used in drinks and cooking."""

_INI = """\
[server]
host = 127.0.0.1
port = 8000
debug = false

[database]
url = sqlite:///data/app.db
echo = false
pool_size = 5

[cache]
backend = redis
host = localhost
port = 6379
ttl = 300"""

_BUGGY = '''\
def find_max(numbers):
    """Return the largest number in the list."""
    if not numbers:
        return None
    largest = numbers[0]
    for n in numbers:
        if n < largest:
            largest = n
    return largest


def count_words(text):
    """Return a dict of word -> number of times it appears."""
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts'''

GROUNDED: list[tuple[str, str]] = [
    (
        "fix_typos",
        "Rewrite the following paragraph, correcting every spelling mistake. Keep everything "
        f"else exactly the same and reply with the corrected paragraph only.\n\n{_PARAGRAPH}",
    ),
    (
        "rename_variable",
        "In the following Python function, rename the variable `tmp` to `total` everywhere. "
        f"Reply with the whole function.\n\n```python\n{_FUNCTION}\n```",
    ),
    (
        "quote_passage",
        "Read the passage and then copy, word for word, every sentence that mentions a year."
        f"\n\nPassage:\n{_PASSAGE}",
    ),
    (
        "json_to_yaml",
        f"Convert this JSON configuration to YAML.\n\n```json\n{_JSON}\n```",
    ),
    (
        "json_to_table",
        "Turn this JSON list into a markdown table with the columns name, age, city and role."
        f"\n\n```json\n{_PEOPLE}\n```",
    ),
    (
        "csv_to_json",
        "Convert this CSV to JSON: a list with one object per row and the column names as "
        'keys. The first row becomes {"id": 101, "product": "Desk Lamp", "category": '
        f'"lighting", "price": 24.99, "stock": 120}}.\n\n```csv\n{_CSV}\n```',
    ),
    (
        "add_docstrings",
        "Add type hints and a one-line docstring to each function below. Reply with the "
        f"complete code.\n\n```python\n{_CODE}\n```",
    ),
    (
        "continue_list",
        "Here is a list of fruits. Repeat the list and continue it up to 12 items, in exactly "
        f"the same format.\n\n{_LIST}",
    ),
    (
        "ini_to_toml",
        f"Translate this INI configuration file to TOML.\n\n```ini\n{_INI}\n```",
    ),
    (
        "fix_bug",
        "The function find_max below has a bug. Fix it and reply with the whole snippet, "
        f"both functions included.\n\n```python\n{_BUGGY}\n```",
    ),
]

CHAT: list[tuple[str, str]] = [
    ("photosynthesis", "How does photosynthesis work? Explain it to a high-school student."),
    ("sleep", "What are some good habits for getting better sleep?"),
    ("rome", "Why did the Roman Empire fall?"),
    ("recursion", "What is recursion in programming? Give an example."),
    ("bread", "How do I bake a simple loaf of bread at home?"),
    ("volcano", "Why do volcanoes erupt?"),
    ("interview", "How should I prepare for a job interview?"),
    ("seasons", "What causes the seasons on Earth?"),
    ("exercise", "What are the benefits of regular exercise?"),
    ("story", "Write a short story about a robot who learns to paint."),
]

SETS = {"grounded": GROUNDED, "chat": CHAT}


def lookup_tokens_per_step(context: list[int], output: list[int], k: int, lo: int, hi: int):
    """Tokens a greedy verify step would keep if drafts came from the latest earlier match of
    the longest n-gram (lo..hi) ending the text so far: how input-grounded an answer is."""
    i = steps = 0
    while i < len(output):
        text, draft = context + output[:i], []
        for n in range(min(hi, len(text) - 1), lo - 1, -1):
            tail = text[-n:]
            s = next((s for s in range(len(text) - n - 1, -1, -1) if text[s : s + n] == tail), None)
            if s is not None:
                draft = text[s + n : s + n + k]
                break
        kept = 0
        while kept < len(draft) and i + kept < len(output) and draft[kept] == output[i + kept]:
            kept += 1
        i, steps = i + kept + 1, steps + 1
    return len(output) / max(steps, 1)


def show(args, prompts: dict[str, list[list[int]]]) -> None:
    """Each answer (speculation off), its length and its n-gram lookup tokens per step."""
    from pagellm import LLM, SamplingParams

    llm = LLM(dtype=args.dtype)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for name, ids_list in prompts.items():
        for (title, _), ids in zip(SETS[name], ids_list):
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
            per_step = lookup_tokens_per_step(
                ids, list(out.token_ids), args.k, args.prompt_lookup_min, args.prompt_lookup_max
            )
            head = f"=== {name}/{title}: {len(ids)} prompt tokens, {len(out.token_ids)} out"
            print(f"{head} ({out.finish_reason}), lookup tokens/step {per_step:.2f}\n{out.text}")


def tokenize_sets(names: list[str], limit: int | None) -> dict[str, list[list[int]]]:
    """Each set's conversations through the embedded model's chat template, as token ids
    (what `LLM.chat` sends the engine)."""
    from pagellm.engine.chat_template import render_chat
    from pagellm.loader import resolve_model_source
    from pagellm.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_source(None))
    out = {}
    for name in names:
        chats = SETS[name][:limit] if limit else SETS[name]
        texts = [render_chat(tokenizer, [{"role": "user", "content": m}]) for _, m in chats]
        out[name] = [tokenizer.encode(t) for t in texts]
    return out
