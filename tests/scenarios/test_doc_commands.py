"""The docs' `jaxpar` commands still parse and pass the config checks (tests/scenarios/doc_commands.py)."""

from . import doc_commands


def test_every_command_the_docs_show_parses_and_passes_the_checks():
    found = doc_commands.commands()
    assert len(found) > 50 and {c.argv[0] for c in found} >= {"train", "explain", "plan", "sample", "export"}
    failed = [f"{c.where()}: {why}" for c in found if (why := doc_commands.check(c))]
    assert not failed, "\n".join(failed)


def test_a_drifted_command_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\n.venv/bin/jaxpar train llama --set train.stpes=3   # a typo\n"
                    ".venv/bin/jaxpar train llama --set mesh.tensor=3 \\\n  --set train.steps=2\n"
                    "mkdir -p runs && .venv/bin/jaxpar explain llama --no-such-flag\n"
                    ".venv/bin/jaxpar train llama --set train.steps=2 > runs/log.txt\n```\n"
                    "```\n.venv/bin/jaxpar not bash\n```\n")
    found = doc_commands.commands([page])
    assert [c.line for c in found] == [2, 3, 5, 6]
    why = [doc_commands.check(c) for c in found]
    assert "unknown key 'train.stpes'" in why[0] and "mesh.tensor=3 does not divide the 8 devices" in why[1]
    assert why[2] == "the command line does not parse" and why[3] is None
