"""Browser-test plumbing: lets fixtures see whether the test they wrap failed."""

import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    # Kept on the item so the page fixture can take a screenshot only when the test failed.
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report
