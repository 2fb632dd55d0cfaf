"""Counts test cases from meson's logs: each GoogleTest case is one test (from the JUnit log);
a meson test that failed without reporting a failing case (a crash, a timeout) counts once more.
A directory holding `job-result` (a job that is not a meson suite: .ci/task deb) counts as one
test that passed or failed. A directory holding `task-failed` (its .ci/task failed: a build that
broke, which no test log reports) counts one failed test more. A build's logs are testlog.json,
or testlog-<setup>.json where `meson test --setup <setup>` ran (asan, tsan)."""
import glob
import json
import os
import sys
import xml.etree.ElementTree as ET


def count_log(jsonl, junit):
    """(passed, failed, skipped) of one meson test log and its JUnit twin."""
    passed = failed = skipped = 0
    failing_cases = {}
    if os.path.exists(junit):
        for suite in ET.parse(junit).getroot().iter("testsuite"):
            test = suite.get("name", "").split(".")[1] if "." in suite.get("name", "") else suite.get("name")
            for case in suite.iter("testcase"):
                if case.find("failure") is not None or case.find("error") is not None:
                    failed += 1
                    failing_cases[test] = failing_cases.get(test, 0) + 1
                elif case.find("skipped") is not None:
                    skipped += 1
                else:
                    passed += 1
    with open(jsonl) as f:
        for line in f:
            entry = json.loads(line)
            if entry["result"] in ("FAIL", "TIMEOUT", "ERROR", "UNEXPECTEDPASS") and not failing_cases.get(entry["name"]):
                failed += 1
            elif entry["result"] == "SKIP":
                skipped += 1
            elif entry["result"] == "OK" and entry.get("protocol") != "gtest" and "fuzz" in entry["name"]:
                passed += 1
    return passed, failed, skipped


passed = failed = skipped = 0
for build in sys.argv[1:]:
    if os.path.exists(os.path.join(build, "task-failed")):
        failed += 1
    job_result = os.path.join(build, "job-result")
    if os.path.exists(job_result):
        with open(job_result) as f:
            if f.read().strip() == "pass":
                passed += 1
            else:
                failed += 1
        continue
    for jsonl in sorted(glob.glob(os.path.join(build, "meson-logs", "testlog*.json"))):
        p, f, s = count_log(jsonl, jsonl[: -len(".json")] + ".junit.xml")
        passed, failed, skipped = passed + p, failed + f, skipped + s
print(f"{passed} passed, {failed} failed, {skipped} skipped")
