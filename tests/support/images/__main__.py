"""``python -m support.images`` (from tests/): build the operator image, or find it cached, and
print its name, archive and size (what ``make operator-image`` runs before the suites)."""

from support.images import operator_image

built = operator_image()
print(built.name, built.path, built.path.stat().st_size)
