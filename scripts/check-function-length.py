#!/usr/bin/env python3
"""Lists the C++ functions in server/ and client/ that are longer than a limit (80 lines).

A function's length runs from the first line of its declaration to the line of its closing brace.
Lambdas, local classes and nested blocks count within the function that holds them. The scanner
matches braces after blanking comments, string, raw-string and character literals and preprocessor
lines; it knows namespaces, classes, enums, initializers and constructor initializer lists, which
is what the C++ of this tree uses. It is not a C++ parser.

Exit 0: every function fits; 1: functions to split (listed as file:line: name: N lines);
2: a file it could not scan (unbalanced braces).

  scripts/check-function-length.py                 server/ and client/ (without client/python)
  scripts/check-function-length.py --max-lines=N   another limit
  scripts/check-function-length.py --allow=server/x.cc:Class::Method
                                                   a long function still to be split: listed, but
                                                   not a failure (a note says when it fits again)
  scripts/check-function-length.py FILE...         only these files
"""

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("server", "client")
SKIPPED = (os.path.join("client", "python"),)
SUFFIXES = (".cc", ".cpp", ".h")

IDENTIFIER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
NOT_FUNCTION_NAMES = frozenset(
    ["if", "for", "while", "switch", "catch", "return", "sizeof", "alignof", "alignas", "decltype",
     "noexcept", "static_assert", "__attribute__", "requires"])


class ScanError(Exception):
    pass


def blank(text, start, end):
    """The text of [start, end) as spaces, newlines kept (so line numbers stay)."""
    return "".join("\n" if c == "\n" else " " for c in text[start:end])


def strip_literals(text):
    """Replaces comments, literals' contents and preprocessor lines with spaces, newlines kept.

    String literals keep their quotes ("" with blanks between), so that `extern "C"` stays
    recognisable."""
    out = []
    i = 0
    n = len(text)
    at_line_start = True  # only whitespace since the last newline
    while i < n:
        c = text[i]
        if c == "\n":
            out.append(c)
            i += 1
            at_line_start = True
            continue
        if at_line_start and c == "#":
            # A preprocessor directive, with its backslash continuations (and comments inside).
            j = i
            while j < n:
                if text[j] == "\n" and text[j - 1] != "\\":
                    break
                if text.startswith("/*", j):
                    close = text.find("*/", j + 2)
                    j = n if close < 0 else close + 2
                    continue
                j += 1
            out.append(blank(text, i, j))
            i = j
            continue
        if not c.isspace():
            at_line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text, i, j))
            i = j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(blank(text, i, j))
            i = j
            continue
        if c == '"':
            prefix_start = i
            while prefix_start > 0 and text[prefix_start - 1] in IDENTIFIER_CHARS:
                prefix_start -= 1
            prefix = text[prefix_start:i]
            if prefix.endswith("R") and prefix in ("R", "u8R", "uR", "UR", "LR"):
                open_paren = text.find("(", i + 1)
                delimiter = text[i + 1:open_paren]
                closing = ")" + delimiter + '"'
                j = text.find(closing, open_paren + 1)
                if open_paren < 0 or j < 0:
                    raise ScanError("unterminated raw string at offset %d" % i)
                j += len(closing)
            else:
                j = i + 1
                while j < n and text[j] != '"':
                    if text[j] == "\\":
                        j += 1
                    elif text[j] == "\n":
                        raise ScanError("unterminated string at offset %d" % i)
                    j += 1
                j += 1
            out.append('"' + blank(text, i + 1, j - 1) + '"')
            i = j
            continue
        if c == "'":
            # A digit separator (1'000'000, 0xFF'FF) when the token before it is a number.
            token_start = i
            while token_start > 0 and (text[token_start - 1] in IDENTIFIER_CHARS or
                                       text[token_start - 1] in ".'"):
                token_start -= 1
            if token_start < i and text[token_start].isdigit():
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != "'":
                if text[j] == "\\":
                    j += 1
                elif text[j] == "\n":
                    raise ScanError("unterminated character literal at offset %d" % i)
                j += 1
            j += 1
            out.append(blank(text, i, j))
            i = j
            continue
        out.append(c)
        i += 1
    return "".join(out)


def matching_brace(code, open_index):
    """The index of the '}' that closes the '{' at open_index."""
    depth = 0
    for j in range(open_index, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    raise ScanError("unbalanced '{' at offset %d" % open_index)


def strip_template_prefix(header):
    """The header without its leading `template <...>` clauses."""
    while True:
        match = re.match(r"\s*template\s*<", header)
        if not match:
            return header
        depth = 0
        for j in range(match.end() - 1, len(header)):
            if header[j] == "<":
                depth += 1
            elif header[j] == ">":
                depth -= 1
                if depth == 0:
                    header = header[j + 1:]
                    break
        else:
            return header


def parameter_list_start(header):
    """The index of the '(' that opens a function header's parameter list, or -1.

    It is the first '(' outside angle brackets that follows a name which is not a keyword."""
    angle = 0
    paren = 0
    for j, c in enumerate(header):
        if c == "<" and paren == 0:
            if header[max(0, j - 8):j].endswith("operator"):
                continue
            angle += 1
        elif c == ">" and paren == 0:
            if j > 0 and header[j - 1] == "-":
                continue
            angle = max(0, angle - 1)
        elif c == "(":
            if paren == 0 and angle == 0:
                name = function_name(header, j)
                if name and name.split("::")[-1] not in NOT_FUNCTION_NAMES:
                    return j
            paren += 1
        elif c == ")":
            paren = max(0, paren - 1)
    return -1


def function_name(header, paren_index):
    """The (qualified) name before the '(' at paren_index: `Class::Method`, `operator()`."""
    before = header[:paren_index].rstrip()
    match = re.search(r"((?:[A-Za-z_]\w*\s*(?:<[^<>()]*>)?\s*::\s*)*~?"
                      r"(?:operator\s*(?:\(\)|[^\w\s(]+|\w[\w\s:*&<>]*?)|[A-Za-z_]\w*))$", before)
    if not match:
        if before.endswith("]"):
            return "lambda"
        return None
    return re.sub(r"\s+", "", match.group(1))


def top_level_colon_after(header, start):
    """Whether the header has a lone ':' (not '::') at paren depth 0 after start: an initializer
    list follows the parameters."""
    paren = 0
    j = start
    while j < len(header):
        c = header[j]
        if c == "(":
            paren += 1
        elif c == ")":
            paren -= 1
        elif c == ":" and paren == 0:
            if header.startswith("::", j):
                j += 2
                continue
            return True
        j += 1
    return False


def matching_paren(text, open_index):
    depth = 0
    for j in range(open_index, len(text)):
        if text[j] == "(":
            depth += 1
        elif text[j] == ")":
            depth -= 1
            if depth == 0:
                return j
    return len(text)


ACCESS_LABEL = re.compile(r"^\s*(?:public|private|protected)\s*:(?!:)")


def classify(header):
    """What a '{' opens at declaration scope, from the text before it since the last ';', '{' or
    '}': 'scope' (namespace, class, extern "C"), 'skip' (enum, initializer) or 'function'."""
    while True:
        match = ACCESS_LABEL.match(header)
        if not match:
            break
        header = header[match.end():]
    stripped = strip_template_prefix(header).strip()
    if re.search(r"\bnamespace\b", stripped) or re.match(r'extern\s*""\s*$', stripped):
        return "scope", header
    if re.search(r"\benum\b", stripped):
        return "skip", header
    if stripped.endswith("=") or not stripped:
        return "skip", header
    parameters = parameter_list_start(stripped)
    if re.match(r"(?:\w+\s+)*?(?:class|struct|union)\b", stripped) and (
            parameters < 0 or not re.search(r"\)[\w\s&]*(?:->.*)?$", stripped)):
        return "scope", header
    if parameters < 0:
        return "skip", header
    return "function", header


def scan_functions(code):
    """Yields (header_start, body_open, body_close, name) for every function in the code."""
    stack = []  # the declaration scopes' statement starts
    i = 0
    statement_start = 0
    n = len(code)
    while i < n:
        c = code[i]
        if c == ";":
            statement_start = i + 1
        elif c == "}":
            if not stack:
                raise ScanError("unbalanced '}' at offset %d" % i)
            stack.pop()
            statement_start = i + 1
        elif c == "{":
            kind, header = classify(code[statement_start:i])
            if kind == "scope":
                stack.append(statement_start)
                statement_start = i + 1
            elif kind == "skip":
                i = matching_brace(code, i)
                # An initializer or enum ends at its ';', which resets the statement.
            else:
                stripped = strip_template_prefix(header)
                parameters = parameter_list_start(stripped)
                close = matching_paren(stripped, parameters)
                before = code[:i].rstrip()
                if (top_level_colon_after(stripped, close + 1) and before and
                        (before[-1] in IDENTIFIER_CHARS or before[-1] == ">")):
                    # A member's brace initializer in a constructor's initializer list.
                    i = matching_brace(code, i) + 1
                    continue
                body_close = matching_brace(code, i)
                statement = code[statement_start:i]
                header_start = statement_start + len(statement) - len(statement.lstrip())
                name = function_name(stripped, parameters) if parameters >= 0 else None
                yield header_start, i, body_close, name or "?"
                i = body_close
                statement_start = i + 1
        i += 1
    if stack:
        raise ScanError("unbalanced '{': %d scopes left open" % len(stack))


def long_functions(path, max_lines):
    with open(path, encoding="utf-8") as source:
        text = source.read()
    code = strip_literals(text)
    found = []
    for header_start, _, body_close, name in scan_functions(code):
        first_line = code.count("\n", 0, header_start) + 1
        last_line = code.count("\n", 0, body_close) + 1
        length = last_line - first_line + 1
        if length > max_lines:
            found.append((first_line, name, length))
    return found


def source_files():
    for folder in FOLDERS:
        for directory, subdirectories, files in os.walk(os.path.join(ROOT, folder)):
            relative = os.path.relpath(directory, ROOT)
            if any(relative == skipped or relative.startswith(skipped + os.sep)
                   for skipped in SKIPPED):
                subdirectories[:] = []
                continue
            subdirectories.sort()
            for name in sorted(files):
                if name.endswith(SUFFIXES):
                    yield os.path.join(relative, name)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-lines", type=int, default=80)
    parser.add_argument("--allow", action="append", default=[], metavar="PATH:NAME")
    parser.add_argument("files", nargs="*")
    args = parser.parse_args()
    os.chdir(ROOT)
    files = args.files or list(source_files())
    allowed = set(args.allow)
    matched = set()
    too_long = []
    still_allowed = []
    unreadable = []
    for path in files:
        try:
            for line, name, length in long_functions(path, args.max_lines):
                entry = "%s:%d: %s: %d lines" % (path, line, name, length)
                if "%s:%s" % (path, name) in allowed:
                    matched.add("%s:%s" % (path, name))
                    still_allowed.append(entry)
                else:
                    too_long.append(entry)
        except ScanError as error:
            unreadable.append("%s: %s" % (path, error))
    for problem in unreadable:
        print("check-function-length: cannot scan " + problem, file=sys.stderr)
    for entry in still_allowed:
        print("check-function-length: allowed for now (--allow), still to split: " + entry)
    for entry in sorted(allowed - matched):
        print("check-function-length: --allow=%s is no longer needed (it fits, or is gone)" % entry)
    if too_long:
        print("check-function-length: %d functions longer than %d lines (split them into named "
              "steps):" % (len(too_long), args.max_lines))
        for entry in too_long:
            print("  " + entry)
    else:
        print("check-function-length: %d files, every function within %d lines%s" %
              (len(files), args.max_lines, " but the allowed ones" if still_allowed else ""))
    if unreadable:
        return 2
    return 1 if too_long else 0


if __name__ == "__main__":
    sys.exit(main())
