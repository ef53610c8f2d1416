#!/usr/bin/env python3
"""Finds import cycles between a crate's modules.

Reads every `crate::a::b` path in the crate's code (use lines and paths in code alike; not
comments),
maps each file to its module (src/x.rs and src/x/mod.rs are `x`; src/x/y.rs is `x::y`), and
reports the strongly connected components of more than one module: modules that depend on
each other in a circle, so none can be read or changed without the others. A dependency on a
module's child counts as one on the child; `super::` paths count too.

Usage: scripts/module-cycles.py CRATE_DIR [--allow N]
Exits 1 when a cycle has more than N modules (default 1: none allowed).
"""
import os
import re
import sys


def module_of(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] == "mod":
        rel = rel[:-1]
    if rel in (["lib"], ["main"]):
        return ""
    return "::".join(rel)


def main():
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        return 2
    crate = args[0]
    allow = 1
    if "--allow" in args:
        allow = int(args[args.index("--allow") + 1])
    src = os.path.join(crate, "src")
    files = {}
    for root, _, names in os.walk(src):
        for name in names:
            if name.endswith(".rs"):
                path = os.path.join(root, name)
                files[module_of(src, path)] = path
    modules = set(files)
    edges = {m: set() for m in modules}
    for module, path in files.items():
        text = open(path, encoding="utf-8").read()
        # Leave out test modules (a test may reach anywhere) and comments (a doc link is not
        # a dependency).
        text = re.split(r"#\[cfg\(test\)\]\s*mod tests", text)[0]
        text = re.sub(r"//[^\n]*", "", text)
        for match in re.finditer(r"\b(crate|super)((?:::[a-z_][a-z0-9_]*)+)", text):
            kind, rest = match.group(1), match.group(2)[2:].split("::")
            if kind == "super":
                base = module.split("::")[:-1] if module else []
                parts = base + rest
            else:
                parts = rest
            # The longest prefix that is a module.
            target = None
            for n in range(len(parts), 0, -1):
                candidate = "::".join(parts[:n])
                if candidate in modules:
                    target = candidate
                    break
            if target is not None and target != module:
                edges[module].add(target)
    # Tarjan's strongly connected components.
    index, low, stack, on, comps = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(modules):
        if v not in index:
            visit(v)
    cycles = [c for c in comps if len(c) > 1]
    worst = max((len(c) for c in cycles), default=1)
    for c in sorted(cycles, key=len, reverse=True):
        print(f"{crate}: a cycle of {len(c)} modules: {', '.join(m or 'lib' for m in c)}")
    if worst > allow:
        return 1
    print(f"{crate}: {len(modules)} modules, largest cycle {worst} (allowed {allow})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
