"""The ground floor: what every app shares, importing no app.

Errors the apps raise and the API maps to HTTP (`errors`), sending a Celery task by name after
commit (`dispatch`), and the small API helpers (`fields`, `nulls`, `pagination`, `filters`,
`parsers`). Nothing here imports `portal`, `tenants`, `quotas`, `runners` or `frontend`; the layer
test in tests/test_layers.py holds it to that.
"""
