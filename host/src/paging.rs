//! Listings in pages: the operator's lists (dead letters, quarantined messages, timers) can
//! hold any number of rows, so each answer holds at most a page of them and says where the
//! next one begins. A page is read by a keyset (the listing's order, past the cursor), never
//! by an offset, so a page costs the same deep in a long list, and rows added or removed
//! meanwhile shift no other row into a later page twice or out of it. A row whose own place
//! in the order changes between pages (a timer rescheduled, retried or backed off moves by
//! its due time) may be listed twice, or not at all.

use serde::Serialize;

/// The most rows one page holds, and the size of a page that asks for none.
pub const MAX_ROWS: i64 = 1000;

/// Which page to read: the rows after `after` (a cursor from the previous page), at most
/// `limit` of them.
#[derive(Debug, Clone, Default)]
pub struct PageRequest {
    pub after: Option<String>,
    pub limit: Option<i64>,
}

/// A request that cannot be served: its limit or cursor is not one the listing gave.
#[derive(Debug, thiserror::Error)]
pub enum PageError {
    #[error("limit must be between 1 and {MAX_ROWS}")]
    Limit,
    #[error("the cursor `after` is not one this listing gave")]
    Cursor,
}

/// Why a listing gave no page.
#[derive(Debug, thiserror::Error)]
pub enum ListError {
    #[error(transparent)]
    Page(#[from] PageError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl PageRequest {
    /// How many rows the page holds at most.
    pub fn rows(&self) -> Result<i64, PageError> {
        match self.limit {
            None => Ok(MAX_ROWS),
            Some(n) if (1..=MAX_ROWS).contains(&n) => Ok(n),
            Some(_) => Err(PageError::Limit),
        }
    }

    /// The cursor, read by `parse`; `None` for the first page.
    pub fn cursor<C>(&self, parse: impl FnOnce(&str) -> Option<C>) -> Result<Option<C>, PageError> {
        self.after
            .as_deref()
            .map(|a| parse(a).ok_or(PageError::Cursor))
            .transpose()
    }
}

/// One page of a listing, and the cursor of the next, if there are more rows.
#[derive(Debug, Serialize)]
pub struct Page<T> {
    pub rows: Vec<T>,
    pub next: Option<String>,
}

impl<T> Page<T> {
    /// A page from `rows`, read with a limit of one more than `size`: a row past `size`
    /// means there are more, and the cursor of the page's last row is where they begin.
    pub fn of(mut rows: Vec<T>, size: i64, cursor: impl Fn(&T) -> String) -> Page<T> {
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        let next = if rows.len() > size {
            rows.truncate(size);
            rows.last().map(cursor)
        } else {
            None
        };
        Page { rows, next }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_read_one_row_long_has_a_next_cursor_and_one_read_short_has_none() {
        let full = Page::of(vec![5, 4, 3], 2, |n| n.to_string());
        assert_eq!((full.rows, full.next.as_deref()), (vec![5, 4], Some("4")));
        let last = Page::of(vec![2, 1], 2, |n| n.to_string());
        assert_eq!((last.rows, last.next), (vec![2, 1], None));
    }

    #[test]
    fn a_limit_out_of_range_or_a_foreign_cursor_is_refused() {
        let ask = |limit| PageRequest { after: None, limit };
        assert_eq!(ask(None).rows().unwrap(), MAX_ROWS);
        assert_eq!(ask(Some(7)).rows().unwrap(), 7);
        assert!(matches!(ask(Some(0)).rows(), Err(PageError::Limit)));
        assert!(matches!(ask(Some(MAX_ROWS + 1)).rows(), Err(PageError::Limit)));
        let after = PageRequest {
            after: Some("x".into()),
            limit: None,
        };
        assert!(matches!(
            after.cursor(|a| a.parse::<i64>().ok()),
            Err(PageError::Cursor)
        ));
    }
}
