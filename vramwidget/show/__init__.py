"""What the user sees of an estimate: Altair charts (``charts``), the treemap layout
(``treemap``) and the offline chart renderer for notebooks (``chartview``)."""
