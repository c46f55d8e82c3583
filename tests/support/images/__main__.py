"""``python -m support.images`` (from tests/): build the operator and trainer images, or find them
cached, and print each one's name, archive and size (what ``make images`` runs before the suites)."""

from support.images import operator_image, trainer_image

for built in (operator_image(), trainer_image()):
    print(built.name, built.path, built.path.stat().st_size)
