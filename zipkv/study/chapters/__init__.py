"""What the chapter notebooks show: their tables, figures and verdict sentences, computed from their results. One
module per chapter or family of chapters; the computations themselves live in the library."""
