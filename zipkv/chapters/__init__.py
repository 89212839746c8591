"""What each chapter notebook shows: its tables, figures and verdict sentences, computed from the
chapter's results. One module per chapter; the computations themselves live in the library."""
