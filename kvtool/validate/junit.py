"""JUnit XML, the format CI systems read: one test case per (scenario, model, check)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from kvtool.validate.results import CheckResult, Verdict


def junit_xml(results: list[CheckResult], target: str, properties: dict[str, str] | None = None) -> str:
    """`properties` (the seed, say) go in the suite's <properties>."""
    total = sum(r.seconds for r in results)
    failures = sum(r.verdict is Verdict.FAIL for r in results)
    errors = sum(r.verdict is Verdict.ERROR for r in results)
    skipped = sum(r.verdict is Verdict.SKIP for r in results)
    root = ET.Element("testsuites", name="kvtool validate", tests=str(len(results)), failures=str(failures),
                      errors=str(errors), skipped=str(skipped), time=f"{total:.3f}")
    suite = ET.SubElement(root, "testsuite", name=f"kvtool validate {target}", tests=str(len(results)),
                          failures=str(failures), errors=str(errors), skipped=str(skipped), time=f"{total:.3f}")
    if properties:
        listed = ET.SubElement(suite, "properties")
        for name, value in properties.items():
            ET.SubElement(listed, "property", name=name, value=value)
    for r in results:
        where = f"{r.model}, {r.runtime}" if r.runtime else r.model
        case = ET.SubElement(suite, "testcase", classname=f"{r.scenario}[{where}]", name=r.check,
                             time=f"{r.seconds:.3f}")
        text = "\n".join(r.evidence)
        if r.verdict is Verdict.FAIL:
            ET.SubElement(case, "failure", message=(r.evidence or [r.check])[0][:500], type="check").text = text
        elif r.verdict is Verdict.ERROR:
            ET.SubElement(case, "error", message=(r.evidence or [r.check])[0][:500], type="error").text = text
        elif r.verdict is Verdict.SKIP:
            ET.SubElement(case, "skipped", message=(r.evidence or [""])[0][:500])
        note = "miss (not a failure without --strict): " if r.verdict is Verdict.MISS else ""
        ET.SubElement(case, "system-out").text = f"{r.purpose}\n{note}{text}"
        if r.tracebacks:
            ET.SubElement(case, "system-err").text = "\n\n".join(r.tracebacks)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"

