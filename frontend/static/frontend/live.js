// Live status without a reload. An element with data-poll-url is replaced, every
// 1.5 s, by the fragment the server renders at that URL. A settled fragment comes
// back without data-poll-url, so polling stops by itself; an empty one (a deleted
// environment's row) removes the element.
(function () {
  "use strict";
  var POLL_INTERVAL_MS = 1500;

  function schedule(element) {
    setTimeout(function () { refresh(element); }, POLL_INTERVAL_MS);
  }

  // The last row gone, a table says what it would have said when rendered empty.
  function removeRow(element) {
    var table = element.closest("table[data-empty-text]");
    element.remove();
    if (table && table.tBodies[0].rows.length === 0) {
      var note = document.createElement("p");
      note.className = "empty";
      note.textContent = table.dataset.emptyText;
      table.replaceWith(note);
    }
  }

  function refresh(element) {
    if (!element.isConnected) return;
    fetch(element.dataset.pollUrl, { credentials: "same-origin" })
      .then(function (response) {
        // A redirect means the session ended (login page) and a 404 that it is gone: stop quietly.
        if (response.redirected || response.status === 404) return null;
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.text();
      })
      .then(function (html) {
        if (html === null) return;
        var template = document.createElement("template");
        template.innerHTML = html.trim();
        var replacement = template.content.firstElementChild;
        if (!replacement) { removeRow(element); return; }
        element.replaceWith(replacement);
        if (replacement.dataset.pollUrl) schedule(replacement);
      })
      .catch(function () { schedule(element); });  // A blip in the network: try again.
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-poll-url]").forEach(schedule);
  });

  // Forms that change something irreversible ask first.
  document.addEventListener("submit", function (event) {
    var question = event.target.dataset && event.target.dataset.confirm;
    if (question && !window.confirm(question)) event.preventDefault();
  });
})();
