package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/internal/browser"
)

func stderrLines(t *testing.T, cmd *exec.Cmd) chan string {
	t.Helper()
	r, err := cmd.StderrPipe()
	require.NoError(t, err)
	lines := make(chan string, 100)
	go func() {
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default:
			}
		}
		close(lines)
	}()
	return lines
}

// TestLocalDashboardShowsHolderAndWaiter (issue 37, "Must show"): gpudra
// local dashboard, the binary, shows a gpudra local run holding all eight
// GPUs of a simulated DGX H100 (its name and user on every card) and a
// second run waiting for one (position 1), in a real browser.
func TestLocalDashboardShowsHolderAndWaiter(t *testing.T) {
	bctx, closeBrowser, err := browser.New(context.Background())
	if err != nil {
		browser.SkipOrFail(t, err)
	}
	defer closeBrowser()
	me, err := user.Current()
	require.NoError(t, err)
	dir := t.TempDir()
	holder := localCmd(t, dir, "run", "--gpus", "8", "--name", "train", "--", "sleep", "120")
	require.NoError(t, holder.Start())
	t.Cleanup(func() { _ = holder.Process.Kill(); _ = holder.Wait() })
	require.Eventually(t, func() bool { return len(psRows(t, dir)) == 1 }, 20*time.Second, 50*time.Millisecond)
	waiter := localCmd(t, dir, "run", "--gpus", "1", "--name", "eval", "--", "true")
	waiterErr := stderrLines(t, waiter)
	require.NoError(t, waiter.Start())
	t.Cleanup(func() { _ = waiter.Process.Kill(); _ = waiter.Wait() })
	waitLine(t, waiterErr, regexp.MustCompile(`eval waits, position 1`))

	bin, err := gpudraBinary()
	require.NoError(t, err)
	dash := exec.Command(bin, "local", "dashboard", "--backend", "sim", "--machine", "dgx-h100-nomig", "--node-name", "box",
		"--state-dir", filepath.Join(dir, "state"), "--address", "127.0.0.1:0", "--interval", "500ms")
	dashErr := stderrLines(t, dash)
	require.NoError(t, dash.Start())
	t.Cleanup(func() { _ = dash.Process.Kill(); _ = dash.Wait() })
	url := waitLine(t, dashErr, regexp.MustCompile(`Serving the dashboard on (http://\S+)`))
	require.Regexp(t, `^http://127\.0\.0\.1:\d+/\?token=\S{26,}$`, url, "the printed URL carries the page's token")

	console, err := browser.CollectConsole(bctx)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(bctx, time.Minute)
	defer cancel()
	poll := func(cond string) {
		t.Helper()
		_, err := chromedp.Run(ctx, chromedp.Poll[bool](cond, chromedp.WithPollingTimeout(20*time.Second), chromedp.WithPollingInterval(50*time.Millisecond)))
		require.NoError(t, err, cond)
	}
	_, err = chromedp.Run(ctx, chromedp.Navigate(url))
	require.NoError(t, err)
	held := fmt.Sprintf(`document.querySelectorAll('[data-testid="gpu"][data-node="box"] [data-testid="holder"][data-local="train"][data-user=%q]').length`, me.Username)
	poll(held + ` === 8`)
	cards, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll('[data-testid="gpu"]').length`))
	require.NoError(t, err)
	assert.Equal(t, 8, cards, "the machine's eight GPUs")

	_, err = chromedp.Run(ctx, chromedp.Navigate(url+"#tab=queues"))
	require.NoError(t, err)
	poll(`document.querySelector('[data-testid="queue-item"][data-kind="Local"][data-name="eval"][data-position="1"][data-holding="false"]') !== null`)
	poll(`document.querySelector('[data-testid="queue-item"][data-kind="Local"][data-name="train"][data-holding="true"]') !== null`)
	if dir := os.Getenv("GPUDRA_SCREENSHOTS_DIR"); dir != "" {
		require.NoError(t, os.MkdirAll(dir, 0o755))
		_, err = chromedp.Run(ctx, browser.Screenshot(filepath.Join(dir, "dashboard-local-queue.png")))
		require.NoError(t, err)
	}
	assert.NoError(t, console.Err(), "the page reported JS exceptions or CSP violations")
}

// waitLine waits for a line matching re and returns its first group (or
// the line).
func waitLine(t *testing.T, lines chan string, re *regexp.Regexp) string {
	t.Helper()
	deadline := time.After(30 * time.Second)
	var seen []string
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("ended without a line matching %s: %q", re, seen)
			}
			seen = append(seen, l)
			if m := re.FindStringSubmatch(l); m != nil {
				if len(m) > 1 {
					return m[1]
				}
				return l
			}
		case <-deadline:
			t.Fatalf("no line matching %s in 30 s: %q", re, seen)
		}
	}
}
