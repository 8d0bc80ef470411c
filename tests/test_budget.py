import re

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


@pytest.mark.parametrize("text", ["150%", 1.5, 10.0, "2000%"])
def test_a_fraction_above_one_reads_as_it_reads(text):
  # A sweep over 50/100/150% does not break on its third value.
  fraction = float(text.rstrip("%")) / 100 if isinstance(text, str) else text
  assert Budget.parse(text).resolve(1000) == int(fraction * 1000)


@pytest.mark.parametrize("bad", [-5, 0, "lots", [1], "0%", "-20%", -0.5, float("inf"), "-3GiB",
                                 "3 parsecs", None, True])
def test_bad_budgets_list_the_accepted_forms(bad):
  with pytest.raises(BudgetError, match="Expected an int number of bytes"):
    Budget.parse(bad)


@pytest.mark.parametrize("bad, hint", [
    ("0.5", "write '50%' or pass the float 0.5"),
    ("1", "write '100%' or pass the float 1"),
    ("4096", "write '4096B' or pass the int 4096"),
    ("2.5", "e.g. '2.5GiB'"),
    ("1e400GB", "too large to be a count of bytes"),
    ("1e400", "too large to be a count of bytes"),
    ("0", "it must be positive"),
    (6e9, "pass the int 6000000000 (or '5.59 GiB')"),  # bytes as a float, not 6e11%
    (12.0, "for that fraction write '1200%'"),
])
def test_a_budget_without_a_unit_or_out_of_range_says_what_was_meant(bad, hint):
  """Issue 20: "0.5" said "unknown unit ''" and "1e400GB" raised a raw
  OverflowError; a float above 10 is refused, since budget=6e9 (bytes
  written as a float) would read as a fraction that needs no plan."""
  with pytest.raises(BudgetError, match=re.escape(hint)):
    Budget.parse(bad)


def test_a_huge_int_budget_is_read():
  assert Budget.parse(10**400).resolve(1) == 10**400
