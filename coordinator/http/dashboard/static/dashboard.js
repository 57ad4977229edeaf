// Refreshes a page that asks for it (<body data-refresh="seconds">): fetches the same URL and
// swaps <main id="live">. No framework, no external assets.
(function () {
  "use strict";
  const seconds = Number(document.body.dataset.refresh || 0);
  if (!seconds) return;
  const stale = document.getElementById("stale");
  async function refresh() {
    if (document.hidden) return;
    try {
      const resp = await fetch(window.location.href, { credentials: "same-origin", cache: "no-store" });
      const html = await resp.text();
      const next = new DOMParser().parseFromString(html, "text/html").getElementById("live");
      if (!resp.ok || resp.redirected || !next) throw new Error("refresh failed: HTTP " + resp.status);
      document.getElementById("live").replaceWith(next);
      stale.hidden = true;
    } catch (err) {
      stale.hidden = false;
    }
  }
  window.setInterval(refresh, seconds * 1000);
})();
