"""The formats ``bench grammar`` checks: 20 JSON schemas (nested objects, arrays, enums,
bounded numbers, patterned strings, optional fields) and 10 regexes, each with a chat request
that asks for it."""

from __future__ import annotations

S = lambda **kw: {"type": "string", **kw}
I = lambda lo=None, hi=None: {"type": "integer", **({"minimum": lo} if lo is not None else {}),
                              **({"maximum": hi} if hi is not None else {})}
N = lambda lo=None, hi=None: {"type": "number", **({"minimum": lo} if lo is not None else {}),
                              **({"maximum": hi} if hi is not None else {})}
E = lambda *vals: {"enum": list(vals)}
A = lambda items, **kw: {"type": "array", "items": items, **kw}


def O(required=None, **props):
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required}


SCHEMAS = [
    ("a person", O(name=S(maxLength=20), age=I(0, 120))),
    ("a book", O(title=S(maxLength=40), author=S(maxLength=30), year=I(1450, 2025))),
    ("the weather in Paris", O(city=S(maxLength=20), temperature_c=N(-50, 60),
                               condition=E("sunny", "cloudy", "rain", "snow"))),
    ("a product review", O(product=S(maxLength=30), stars=I(1, 5), recommend={"type": "boolean"})),
    ("a recipe", O(name=S(maxLength=30), servings=I(1, 12),
                   ingredients=A(S(maxLength=20), minItems=1, maxItems=4))),
    ("a movie", O(title=S(maxLength=40), genre=E("drama", "comedy", "action", "horror"),
                  rating=N(0, 10))),
    ("a city", O(name=S(maxLength=20), country=S(maxLength=20), population=I(0, 40000000))),
    ("an email address book entry", O(name=S(maxLength=20),
                                      email=S(pattern="^[a-z]{1,10}@[a-z]{1,10}\\.com$"))),
    ("a calendar event", O(title=S(maxLength=30), date=S(format="date"),
                           attendees=A(S(maxLength=15), maxItems=3))),
    ("a dog", O(name=S(maxLength=15), breed=S(maxLength=20), age_years=I(0, 25),
                vaccinated={"type": "boolean"})),
    ("a bank transaction", O(amount=N(0, 10000), currency=E("USD", "EUR", "GBP"),
                             kind=E("debit", "credit"))),
    ("a student", O(["name", "grades"], name=S(maxLength=20),
                    grades=A(I(0, 100), minItems=1, maxItems=5), nickname=S(maxLength=10))),
    ("a company", O(name=S(maxLength=30), founded=I(1800, 2025),
                    ceo=O(name=S(maxLength=20), age=I(18, 100)))),
    ("a point in 3D", O(x=N(-100, 100), y=N(-100, 100), z=N(-100, 100))),
    ("a song", O(title=S(maxLength=30), artist=S(maxLength=30), seconds=I(30, 900))),
    ("a to-do item", O(["task", "done"], task=S(maxLength=40), done={"type": "boolean"},
                       priority=E("low", "medium", "high"))),
    ("a US address", O(street=S(maxLength=30), city=S(maxLength=20),
                       zip=S(pattern="^[0-9]{5}$"))),
    ("a flight", O(code=S(pattern="^[A-Z]{2}[0-9]{3}$"), origin=S(pattern="^[A-Z]{3}$"),
                   destination=S(pattern="^[A-Z]{3}$"))),
    ("a shopping cart", O(items=A(O(name=S(maxLength=15), qty=I(1, 9)), minItems=1, maxItems=3),
                          total=N(0, 1000))),
    ("a planet", O(name=S(maxLength=15), moons=I(0, 200), has_rings={"type": "boolean"},
                   type=E("rocky", "gas giant", "ice giant"))),
]

REGEXES = [
    ("a US phone number", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("a date in ISO format", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("a yes or no answer", r"(Yes|No)\. [A-Z][a-z ,]{5,60}\."),
    ("a time of day", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("a hex color", r"#[0-9a-f]{6}"),
    ("an IPv4 address", r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"),
    ("a short list of three fruits", r"[A-Z][a-z]+, [a-z]+ and [a-z]+\."),
    ("a price in dollars", r"\$[0-9]{1,4}\.[0-9]{2}"),
    ("a one-word sentiment", r"(positive|negative|neutral)"),
    ("a haiku's first line", r"[A-Z][a-z]+( [a-z]+){2,6}"),
]


def requests() -> list[tuple[str, list[dict], dict]]:
    """``(name, chat messages, response_format)`` for every format."""
    import json
    out = []
    for what, schema in SCHEMAS:
        msg = (f"Give {what} as a JSON object matching this schema: {json.dumps(schema)}. "
               "Reply with the JSON only.")
        out.append((f"json: {what}", [{"role": "user", "content": msg}],
                    {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    for what, rx in REGEXES:
        out.append((f"regex: {what}", [{"role": "user", "content": f"Write {what}."}],
                    {"type": "regex", "regex": rx}))
    return out
