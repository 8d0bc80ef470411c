import pytest

from jaxmem import Budget, BudgetError


@pytest.mark.parametrize("text, nbytes", [
    (3 * 2**30, 3 * 2**30), ("3GiB", 3 * 2**30), ("512MB", 512 * 10**6),
    ("1.5 GB", 1_500_000_000), ("800 KiB", 800 * 1024), ("4096B", 4096),
])
def test_absolute(text, nbytes):
  assert Budget.parse(text).resolve(10**12) == nbytes


@pytest.mark.parametrize("text", ["60%", 0.6, " 60 % ".replace(" ", "")])
def test_fraction(text):
  assert Budget.parse(text).resolve(1000) == 600


@pytest.mark.parametrize("bad", [-5, 0, "lots", [1], "0%", "120%", 1.5, "-3GiB",
                                 "3 parsecs", None, True])
def test_bad_budgets_list_the_accepted_forms(bad):
  with pytest.raises(BudgetError, match="Expected an int number of bytes"):
    Budget.parse(bad)
